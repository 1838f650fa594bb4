"""Held-out plans for the reserved replay (docs/notes/2026-11-27-fsdp2-request-stream.md): per plan the estimate's
reserved high end (default segments), the same with the replay switched off (the category rules, the figure before
the replay took the plan), and `simulate`'s replay of the fake-tensor run; GiB and % off simulate.

    PYTHONPATH=. .venv/bin/python scripts/check_reserved_heldout.py

Each plan is simulated once (10–60 s on 2 cores); nothing is cached.
"""

from __future__ import annotations

import sys

GIB = 1 << 30
ROWS = [
    ("qwen2.5-0.5b", {"batch_size": 1, "seq_len": 1024, "precision": "fp32", "gpus": 4, "zero": 3}),
    ("llama-3.2-1b", {"batch_size": 2, "seq_len": 1024, "precision": "bf16-mixed", "gpus": 8, "zero": 2}),
    ("qwen2.5-1.5b", {"batch_size": 1, "seq_len": 2048, "precision": "bf16", "gpus": 8, "zero": 3,
                      "grad_ckpt": "full", "ckpt_every": 2}),
    ("qwen2.5-0.5b", {"batch_size": 1, "seq_len": 1024, "precision": "bf16-mixed", "gpus": 4, "tp": 2, "zero": 3}),
    ("qwen3-0.6b", {"batch_size": 2, "seq_len": 512, "precision": "bf16-mixed", "gpus": 16, "zero": 3}),
]


def high_end(model: str, fields: dict, replay: bool) -> int:
    from llmem.components import request_stream as rs
    from llmem.estimate import estimate
    from llmem.plan import TrainingPlan
    from llmem.presets import load_preset
    from llmem.spec import ModelSpec

    replays = rs.replays
    if not replay:
        rs.replays = lambda spec, plan: False
    try:
        return estimate(ModelSpec.from_config(load_preset(model)), TrainingPlan(**fields)).reserved_bytes_range[1]
    finally:
        rs.replays = replays


def main() -> int:
    from llmem.plan import TrainingPlan
    from llmem.presets import load_preset
    from llmem.simulate import simulate

    print("| model | plan | sim | rules | replay |\n|---|---|---:|---:|---:|")
    for model, fields in ROWS:
        sim = simulate(load_preset(model), TrainingPlan(**fields)).reserved_bytes
        cells = [high_end(model, fields, r) for r in (False, True)]
        shown = ", ".join(f"{k}={v}" for k, v in fields.items())
        print(f"| {model} | {shown} | {sim / GIB:.2f} | "
              + " | ".join(f"{c / GIB:.2f} ({100 * (c / sim - 1):+.1f} %)" for c in cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
