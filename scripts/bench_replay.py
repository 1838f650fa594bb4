"""CPU time of the reserved replay (`request_stream.replayed_reserved_bytes`), which `bench_estimate.py` does not
see (its estimates replay once per plan, then hit the memo). Any checkout can be timed:

    PYTHONPATH=<checkout> .venv/bin/python scripts/bench_replay.py [--rounds 7]

Prints, per model and scheme (1 GPU, DDP 8, ZeRO-1/2/3 8, TP 2 × FSDP2 8; 1 × 2048, bf16-mixed), the median CPU
time of the replay of a plan not asked before (its sequence new, the model's tables warm), and then of a first
1–64-GPU `compare` on an H100 80GB with every row's figures (`Row.to_dict`: the verdict and the high end, as the
CLI and the app show them), in a fresh spec, and how many replays that ran.

    PYTHONPATH=<checkout> .venv/bin/python scripts/bench_replay.py --table MODEL [--settled]

times, in this (fresh) process, that first table (cold: a new spec, the module caches as a first table finds them)
then the same table asked again (warm, median of 5), and splits the cold CPU time by where it is spent: the walks
(`estimate.plan_phases`), writing the layouts' request streams (`request_stream.program_requests`), the point program's
emptied-cache prefixes (`request_stream_point.emptied_prefix`), the replays (`allocator_replay.peak_reserved`), the
max-batch solves (`compare._max_batch_size` less its walks and replays), the rest. `--settled`: every object alive
frozen out of the garbage collector's passes first (`gc.freeze`, as the app's `ui.cache.settle_heap` after its
first page). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import statistics
import sys
import time

MODELS = ("llama-3.1-8b", "llama-3.3-70b-instruct")
SCHEMES = {"1 GPU": {}, "DDP": {"gpus": 8}, "ZeRO-1": {"gpus": 8, "zero": 1}, "ZeRO-2": {"gpus": 8, "zero": 2},
           "ZeRO-3": {"gpus": 8, "zero": 3}, "TP × FSDP2": {"gpus": 8, "tp": 2, "zero": 3}}
COUNTS = (1, 2, 4, 8, 16, 32, 64)


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


def _table(spec) -> None:
    from llmem.compare import compare
    from llmem.gpus import get_gpu
    from llmem.plan import TrainingPlan

    capacity = get_gpu("h100-80gb").memory_bytes
    for n in COUNTS:
        [r.to_dict() for r in compare(spec, TrainingPlan(gpus=n), capacity).rows]


def compare_ms(model: str) -> tuple[float, int]:
    from llmem.components import request_stream as rs
    from llmem.presets import load_preset
    from llmem.spec import ModelSpec

    name = "_replay_slots" if hasattr(rs, "_replay_slots") else "replay_reserved"  # older trees: one name
    inner, calls = getattr(rs, name), []

    def counted(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    setattr(rs, name, counted)
    spec = ModelSpec.from_config(load_preset(model))
    start = time.process_time()
    _table(spec)
    elapsed = time.process_time() - start
    setattr(rs, name, inner)
    return elapsed * 1e3, len(calls)


def _timed(parts: dict, stack: list, module, name: str, part: str) -> None:
    """`module.name` wrapped to add its CPU time, less that of the wrapped calls inside it, to `parts[part]`."""
    inner = getattr(module, name, None)
    if inner is None:  # an older tree
        return

    def wrapper(*args, **kwargs):
        start = time.process_time()
        stack.append(0.0)
        try:
            return inner(*args, **kwargs)
        finally:
            elapsed, nested = time.process_time() - start, stack.pop()
            parts[part] = parts.get(part, 0.0) + elapsed - nested
            if stack:
                stack[-1] += elapsed

    setattr(module, name, wrapper)


def table_split(model: str, settled: bool = False) -> dict:
    from llmem.presets import load_preset
    from llmem.spec import ModelSpec

    out: dict = {"model": model}
    replay = importlib.import_module("llmem.allocator_replay")
    if settled:  # as the app after its first page (`ui.cache.settle_heap`): what is alive frozen out of collections
        gc.collect()
        gc.freeze()
    compare, estimate = importlib.import_module("llmem.compare"), sys.modules["llmem.estimate"]
    rs = importlib.import_module("llmem.components.request_stream")
    point = importlib.import_module("llmem.components.request_stream_point")
    parts: dict = {}
    stack: list = []
    for module, name, part in ((estimate, "plan_phases", "walk"), (compare, "plan_phases", "walk"),
                               (rs, "program_requests", "stream"), (rs, "peak_reserved", "replay"),
                               (replay, "peak_reserved", "replay"), (point, "emptied_prefix", "emptied prefix"),
                               (compare, "_max_batch_size", "max-batch solve")):
        _timed(parts, stack, module, name, part)
    spec = ModelSpec.from_config(load_preset(model))
    start = time.process_time()
    _table(spec)
    cold = time.process_time() - start
    out["cold_ms"] = round(cold * 1e3, 1)
    out |= {f"{k}_ms": round(v * 1e3, 1) for k, v in parts.items()}
    out["other_ms"] = round((cold - sum(parts.values())) * 1e3, 1)
    warm = []
    for _ in range(5):
        start = time.process_time()
        _table(spec)
        warm.append(time.process_time() - start)
    out["warm_ms"] = round(statistics.median(warm) * 1e3, 1)
    return out


def main() -> None:
    from llmem.presets import load_preset
    from llmem.spec import ModelSpec

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--table", metavar="MODEL", help="one first 1-64-GPU table of MODEL, split (see above)")
    ap.add_argument("--settled", action="store_true", help="with --table: gc.freeze() first, as the app does")
    args = ap.parse_args()
    if args.table:
        print(json.dumps(table_split(args.table, args.settled)))
        return
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
