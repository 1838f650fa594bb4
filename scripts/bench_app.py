"""Server time of one input change in the web app, measured in-process with Streamlit's AppTest.

For each change (issue 16, item 14): clear the app's caches, open the page (the first run: imports, the preset),
then make the change — "cold": nothing of the new plan computed yet (the worst of the repetitions: the first also
misses the library's process-wide tables) — then undo it and make it again — "warm": every estimate cached (the
median). The time is the script run as the app measures it (`last_render_ms`, what the server spends before
the browser can draw), the script thread's CPU time (`last_render_cpu_ms`: what the run costs on a machine whose
other processes take their share of the cores; on an idle machine the two agree) and AppTest's wall clock around
`run()`. Prints a Markdown table (docs/APP.md, "Speed") and the load average it ran under.

    .venv/bin/python scripts/bench_app.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import streamlit as st
from streamlit.testing.v1 import AppTest

APP = str(Path(__file__).resolve().parents[1] / "app.py")
FULL = {"model": "llama-3.1-8b", "gpu-type": "a100-80gb", "gpus": "1", "zero": "all"}
LORA = {**FULL, "method": "lora", "precision": "bf16"}
# (name, the page it starts on, widget key, the value it changes to)
CHANGES = (
    ("method full → lora", FULL, "w_method", "lora"),
    ("LoRA rank 16 → 32", LORA, "w_lora_rank", 32),
    ("GPU count 1 → 8", FULL, "w_gpus", 8),
    ("sequence 2048 → 4096", FULL, "w_seq", 4096),
    ("precision bf16-mixed → bf16", FULL, "w_precision", "bf16"),
    ("micro-batch 1 → 2 (8 GPUs)", {**FULL, "gpus": "8"}, "w_batch", 2),
    ("GPU type → H100 (8 GPUs)", {**FULL, "gpus": "8"}, "w_gpu", "h100-sxm"),
    ("GPU count 8 → 1 (Make it fit appears)", {**FULL, "gpus": "8"}, "w_gpus", 1),
    ("preset → llama-3.3-70b-instruct (1 GPU)", FULL, "w_preset", "llama-3.3-70b-instruct"),
)


def _set(at: AppTest, key: str, value) -> None:
    widget = next(w for kind in ("selectbox", "number_input", "text_input", "checkbox")
                  for w in getattr(at, kind) if w.key == key)
    widget.set_value(value)


def _timed(at: AppTest) -> tuple[float, float]:
    start = time.perf_counter()
    at.run()
    wall = (time.perf_counter() - start) * 1000
    assert not at.exception, at.exception[0].message
    return at.session_state["last_render_ms"], at.session_state["last_render_cpu_ms"], wall


def measure(start: dict, key: str, value) -> dict:
    st.cache_resource.clear()
    at = AppTest.from_file(APP, default_timeout=300)
    at.query_params.update(start)
    first = _timed(at)
    before = at.session_state[key]
    _set(at, key, value)
    cold = _timed(at)
    _set(at, key, before)
    at.run()
    _set(at, key, value)
    warm = _timed(at)
    return {"first": first, "cold": cold, "warm": warm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per change: cold the worst, warm the median")
    args = parser.parse_args()
    measure(FULL, "w_batch", 2)  # the process's first page: imports, presets (not counted)
    print("| input change | cold: script ms | cold: script CPU ms | cold: AppTest run ms | warm: script ms | "
          "warm: script CPU ms | warm: AppTest run ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    worst, load = [0.0, 0.0], os.getloadavg()[0]
    for name, start, key, value in CHANGES:
        runs = [measure(start, key, value) for _ in range(args.repeat)]
        cells = [max(r["cold"][i] for r in runs) for i in (0, 1, 2)]  # the worst: the first repetition is coldest
        cells += [statistics.median(r["warm"][i] for r in runs) for i in (0, 1, 2)]
        worst = [max(worst[0], cells[0], cells[3]), max(worst[1], cells[1], cells[4])]
        print(f"| {name} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")
    first = statistics.median(measure(FULL, "w_batch", 2)["first"][0] for _ in range(args.repeat))
    print(f"\nfirst page of a session (caches cleared, modules imported): {first:.0f} ms script; slowest input "
          f"change: {worst[0]:.0f} ms script, {worst[1]:.0f} ms script CPU; load average {load:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
