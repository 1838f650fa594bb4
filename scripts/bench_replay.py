"""CPU time of the reserved replay (`request_stream.replayed_reserved_bytes`), which `bench_estimate.py` does not
sees only in part (the point estimate does not use it; its `compare` asks the high end only of the rows that fit
at the low end, for the recommendation). Any checkout can be timed:

    PYTHONPATH=<checkout> .venv/bin/python scripts/bench_replay.py [--rounds 7]

Prints, per model and scheme (1 GPU, DDP 8, ZeRO-1/2/3 8, TP 2 × FSDP2 8; 1 × 2048, bf16-mixed), the median CPU
time of the replay of a plan not asked before (its sequence new, the model's tables warm), and then of a first
1–64-GPU `compare` on an H100 80GB with every row's figures (`Row.to_dict`: the verdict and the high end, as the
CLI and the app show them), in a fresh spec, and how many replays that ran.
"""

from __future__ import annotations

import argparse
import statistics
import time

MODELS = ("llama-3.1-8b", "llama-3.3-70b-instruct")
SCHEMES = {"1 GPU": {}, "DDP": {"gpus": 8}, "ZeRO-1": {"gpus": 8, "zero": 1}, "ZeRO-2": {"gpus": 8, "zero": 2},
           "ZeRO-3": {"gpus": 8, "zero": 3}, "TP × FSDP2": {"gpus": 8, "tp": 2, "zero": 3}}


def replay_ms(spec, fields: dict, rounds: int) -> float:
    from llmem.components import request_stream as rs
    from llmem.plan import TrainingPlan

    rs.replayed_reserved_bytes(spec, TrainingPlan(batch_size=1, seq_len=999, precision="bf16-mixed", **fields))
    times = []
    for i in range(rounds):
        plan = TrainingPlan(batch_size=1, seq_len=2048 + i, precision="bf16-mixed", **fields)
        start = time.process_time()
        rs.replayed_reserved_bytes(spec, plan)
        times.append(time.process_time() - start)
    return statistics.median(times) * 1e3


def compare_ms(model: str) -> tuple[float, int]:
    from llmem.compare import compare
    from llmem.components import request_stream as rs
    from llmem.gpus import get_gpu
    from llmem.plan import TrainingPlan
    from llmem.presets import load_preset
    from llmem.spec import ModelSpec

    name = "_replay_slots" if hasattr(rs, "_replay_slots") else "replay_reserved"  # older trees: one name
    inner, calls = getattr(rs, name), []

    def counted(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    setattr(rs, name, counted)
    spec, capacity = ModelSpec.from_config(load_preset(model)), get_gpu("h100-80gb").memory_bytes
    start = time.process_time()
    for n in (1, 2, 4, 8, 16, 32, 64):
        [r.to_dict() for r in compare(spec, TrainingPlan(gpus=n), capacity).rows]
    elapsed = time.process_time() - start
    setattr(rs, name, inner)
    return elapsed * 1e3, len(calls)


def main() -> None:
    from llmem.presets import load_preset
    from llmem.spec import ModelSpec

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    print("| plan | " + " | ".join(MODELS) + " |\n|---|" + "---:|" * len(MODELS))
    specs = {m: ModelSpec.from_config(load_preset(m)) for m in MODELS}
    for name, fields in SCHEMES.items():
        cells = [replay_ms(specs[m], fields, args.rounds) for m in MODELS]
        print(f"| replay, {name} | " + " | ".join(f"{c:.1f}" for c in cells) + " |", flush=True)
    cells = [compare_ms(m) for m in MODELS]
    print("| first compare 1–64 GPUs, rows' figures (replays) | "
          + " | ".join(f"{ms:.0f} ({n})" for ms, n in cells) + " |")


if __name__ == "__main__":
    main()
