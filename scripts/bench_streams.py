"""Where a first 1–64-GPU `compare` spends its CPU time: writing the request streams (`request_stream.
program_requests`), replaying them (`allocator_replay.peak_reserved`) and the rest, in a fresh process (run it once
per figure, alternating trees, for a cold table each time):

    PYTHONPATH=<checkout> .venv/bin/python scripts/bench_streams.py llama-3.3-70b-instruct

Prints one line: the model, the table's ms of CPU, and the streams', the replays' and the rest's (every row's
`to_dict`, an H100 80GB, as `bench_replay.py`'s compare).
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    from llmem import allocator_replay
    from llmem.compare import compare
    from llmem.components import request_stream as rs
    from llmem.gpus import get_gpu
    from llmem.plan import TrainingPlan
    from llmem.presets import load_preset
    from llmem.spec import ModelSpec

    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    args = ap.parse_args()
    spent = {"streams": 0.0, "replays": 0.0}

    def timed(part: str, fn):
        def run(*a, **k):
            start = time.process_time()
            try:
                return fn(*a, **k)
            finally:
                spent[part] += time.process_time() - start
        return run

    rs.program_requests = timed("streams", rs.program_requests)
    rs.peak_reserved = timed("replays", rs.peak_reserved)
    allocator_replay.peak_reserved = timed("replays", allocator_replay.peak_reserved)
    spec, capacity = ModelSpec.from_config(load_preset(args.model)), get_gpu("h100-80gb").memory_bytes
    start = time.process_time()
    for n in (1, 2, 4, 8, 16, 32, 64):
        [r.to_dict() for r in compare(spec, TrainingPlan(gpus=n), capacity).rows]
    total = (time.process_time() - start) * 1e3
    streams, replays = spent["streams"] * 1e3, spent["replays"] * 1e3
    print(f"{args.model} table {total:.0f} streams {streams:.0f} replays {replays:.0f} "
          f"rest {total - streams - replays:.0f}")


if __name__ == "__main__":
    main()
