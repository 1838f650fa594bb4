"""Speed and memory of the simulation: each case in a fresh process (import time excluded from the timing).

    .venv/bin/python scripts/bench_simulate.py [--repeat 2] [--json out/bench_simulate.json]

Cases (the issue's targets): llama-3.1-8b on one rank, micro-batch 1 × 2048 (< 15 s); llama-3.3-70b-instruct
ZeRO-3 rank 0 of 8 (< 60 s). Reported per case: wall and CPU seconds of `simulate()` (build, wrap, two
iterations, allocator replay), the best of `--repeat` runs in the same process (the first one pays for lazy imports
inside transformers and torch), the process's peak RSS and its RSS before simulating (the simulation's own memory
is the difference), and the load average (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CASES = [
    {"name": "8B single rank", "model": "llama-3.1-8b", "plan": {"batch_size": 1, "seq_len": 2048}, "target_s": 15},
    {"name": "70B ZeRO-3, rank 0 of 8", "model": "llama-3.3-70b-instruct",
     "plan": {"batch_size": 1, "seq_len": 2048, "gpus": 8, "zero": 3}, "target_s": 60},
]

CHILD = r"""
import json, resource, sys, time
from llmem.plan import TrainingPlan
from llmem.presets import load_preset
from llmem.simulate import simulate
import llmem.runtime, transformers, torch  # noqa: F401  (imports are not the simulation)
case = json.loads(sys.argv[1]); repeat = int(sys.argv[2])
config = load_preset(case["model"]); plan = TrainingPlan(**case["plan"])
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
runs = []
for _ in range(repeat):
    w, c = time.perf_counter(), time.process_time()
    sim = simulate(config, plan)
    runs.append((time.perf_counter() - w, time.process_time() - c))
print(json.dumps({"runs": runs, "peak_bytes": sim.peak_bytes, "peak_phase": sim.peak_phase, "ops": sim.ops,
                  "events": sim.events, "rss_before": rss0,
                  "rss_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def run_case(case: dict, repeat: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent), "TRANSFORMERS_VERBOSITY": "error",
           "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(case), str(repeat)], capture_output=True,
                         text=True, env=env, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    best = min(res["runs"])
    return {**case, **res, "wall_s": round(best[0], 2), "cpu_s": round(best[1], 2),
            "first_wall_s": round(res["runs"][0][0], 2), "own_memory_bytes": res["rss_peak"] - res["rss_before"],
            "load_average": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    results = []
    for case in CASES:
        r = run_case(case, args.repeat)
        results.append(r)
        ok = "ok" if r["wall_s"] < r["target_s"] else "OVER"
        print(f"{r['name']:<26} wall {r['wall_s']:6.1f} s (first {r['first_wall_s']:.1f} s), cpu {r['cpu_s']:6.1f} s,"
              f" target {r['target_s']} s: {ok}; peak RSS {r['rss_peak'] / 2**30:.2f} GiB, of it the simulation "
              f"{r['own_memory_bytes'] / 2**30:.2f} GiB; {r['ops']:,} ops; load {r['load_average']:.1f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if all(r["wall_s"] < r["target_s"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
