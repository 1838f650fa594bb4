"""The request streams themselves (`request_stream.program_requests`: every request's key, bytes and stream, in order,
and the phase marks), one JSON line a plan with a digest of the stream at the plan's sizes and of its layout's
stream (`_Skeleton`, the sizes as named slots), so that a change to how the streams are written is shown to write the
same requests:

    PYTHONPATH=. .venv/bin/python scripts/check_stream_identity.py > before.jsonl   # on the old tree
    PYTHONPATH=. .venv/bin/python scripts/check_stream_identity.py > after.jsonl    # on the new tree
    diff before.jsonl after.jsonl

Plans: a grid (`GRID`) of the schemes, precisions and checkpointing the stream writes out over four presets (tied
and untied, biases, q/k norms), and scripts/check_replay_identity.py's plans (the first `--draws` of the sweep and
as many moved into the replay's domain); only plans `request_stream.covers`.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

PRESETS = ("qwen3-0.6b", "qwen2.5-0.5b", "llama-3.2-1b", "mistral-7b-v0.3")
SCHEMES = ({}, {"gpus": 4}, {"gpus": 4, "zero": 1}, {"gpus": 4, "zero": 2}, {"gpus": 4, "zero": 3},
           {"gpus": 2, "tp": 2}, {"gpus": 4, "tp": 4}, {"gpus": 8, "tp": 2, "zero": 3},
           {"gpus": 4, "zero": 3, "engine": "fsdp1"})
CKPT = ({}, {"grad_ckpt": "full"}, {"grad_ckpt": "full", "ckpt_every": 2}, {"grad_ckpt": "full", "ckpt_every": 3},
        {"grad_ckpt": "selective"})
GRID = [{**s, **c, "precision": p, "batch_size": b, "seq_len": n, "device": "cuda"}
        for s, c, p, (b, n) in itertools.product(SCHEMES, CKPT, ("fp32", "bf16", "bf16-mixed"), ((1, 512), (2, 1000)))]


def digest(req) -> str:
    return hashlib.sha1(repr((req.events, req.marks)).encode()).hexdigest()


def row(spec, name: str, fields: dict) -> dict | None:
    from llmem.components import request_stream as rs
    from llmem.errors import InputError
    from llmem.plan import TrainingPlan

    try:
        plan = TrainingPlan(**fields)
    except InputError:
        return None
    if not rs.covers(spec, plan):
        return None
    sizes = rs._PlanSizes(spec, plan)
    shape = (len(sizes.table), sizes.upcast, tuple(sizes.names))
    skeleton = rs._Skeleton(*shape, *rs.ckpt_ops.policy_sizes(spec, plan, None))
    return {"model": name, "fields": fields, "stream": digest(rs.program_requests(spec, plan)),
            "layout": digest(rs.program_requests(spec, plan, skeleton))}


def main() -> None:
    from check_replay_identity import plans

    from llmem.presets import load_preset
    from llmem.spec import ModelSpec

    ap = argparse.ArgumentParser()
    ap.add_argument("--draws", type=int, default=300)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    specs: dict = {}
    todo = [(m, load_preset(m), f) for m in PRESETS for f in GRID]
    n = 0
    for name, config, fields in [*todo, *plans(args.draws, args.seed)]:
        key = json.dumps(config, sort_keys=True)
        spec = specs.get(key) or specs.setdefault(key, ModelSpec.from_config(dict(config)))
        out = row(spec, name, fields)
        if out:
            n += 1
            print(json.dumps(out), flush=True)
    print(json.dumps({"plans": n}))


if __name__ == "__main__":
    main()
