"""Every figure of the 1–64-GPU strategy table (`compare`, each row's `to_dict`: the CLI's and the CSV's columns,
the high end included) of every preset, as JSON lines, for a `cmp` of two trees (a speed change must not move a
figure):

    PYTHONPATH=<tree> .venv/bin/python scripts/check_compare_identity.py [--gpu h100-80gb] [--traced] [--models a,b] \
        > out.jsonl

Presets of a family that is not hand-written (traced from transformers, `llmem.derive`: minutes without the disk
cache) are left out unless `--traced`. Prints each preset's CPU time of its first (cold) 1–64-GPU compare on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from llmem.compare import compare
from llmem.errors import InputError
from llmem.families import FAMILIES
from llmem.gpus import get_gpu
from llmem.plan import TrainingPlan
from llmem.presets import load_preset, preset_names
from llmem.spec import ModelSpec

COUNTS = (1, 2, 4, 8, 16, 32, 64)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", default="h100-80gb")
    ap.add_argument("--traced", action="store_true")
    ap.add_argument("--models", default="", help="comma-separated presets (default: every preset)")
    args = ap.parse_args()
    capacity = get_gpu(args.gpu).memory_bytes
    for name in args.models.split(",") if args.models else preset_names():
        config = load_preset(name)
        if config.get("model_type") not in FAMILIES and not args.traced:
            continue
        try:
            spec = ModelSpec.from_config(config)
        except InputError as exc:
            print(json.dumps({"model": name, "refused": str(exc)}))
            continue
        start = time.process_time()
        for n in COUNTS:
            try:
                table = compare(spec, TrainingPlan(gpus=n), capacity)
                best = table.recommended and table.recommended.label
                out = {"rows": [r.to_dict() for r in table.rows], "recommended": best, "reason": table.reason}
            except InputError as exc:
                out = {"refused": str(exc)}
            print(json.dumps({"model": name, "gpus": n, **out}, sort_keys=True, default=str))
        print(f"{name}: {(time.process_time() - start) * 1e3:.0f} ms", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
