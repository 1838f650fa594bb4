"""Every field of `estimate` of this tree against another tree's (a commit before `llmem.walk.replay`), over random
plans: `python scripts/check_replay.py --base <checkout of the older commit> --layouts 600 --seed 1`.

Each layout (every field but the micro-batch and the sequence length) that the plan accepts is drawn by the sweep
(`llmem.sweep.draw`: every option, the sweep's tiny and full-size models of every family, the traced architectures
with `--derived`), on a preset of its family half of the time, then asked at several (batch, seq_len) in turn — so
that the later ones are answered by the compiled record of the layout. Both trees estimate the same list in a
process of their own (`--emit`); each plan's `Estimate.to_dict()`, every phase's breakdown, or its refusal (field
and message) must be the same. Prints the count of plans compared, of plans answered by a record, and every
difference. Each tree traces into a disk cache of its own (`<plans>.<i>.jsonl.cache`; delete it for a cold run)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import subprocess
import sys

BATCHES, SEQS = (1, 1, 2, 3, 4, 8), (1, 7, 32, 64, 100, 128, 256, 511, 512, 1024, 2048, 4096, 4097, 8192)


def draw_plans(layouts: int, seed: int, derived: bool, per_layout: int) -> list[dict]:
    """[{"config": ..., "fields": ...}]: `per_layout` (batch, seq_len) per drawn layout, in order."""
    from llmem.presets import load_preset, supported_presets
    from llmem.sweep.draw import draw_one

    by_type: dict[str, list[str]] = {}
    for info in supported_presets():
        by_type.setdefault(load_preset(info.name).get("model_type"), []).append(info.name)
    sizes = ("small", "full", "derived") if derived else ("small", "full")
    out = []
    index = 0
    for i in range(layouts):
        rng = random.Random(f"replay:{seed}:{i}")
        while (d := draw_one(seed, index, sizes[i % len(sizes)], rng.choice(("cpu", "cuda")))).refusal():
            index += 1  # a plan the plan itself refuses (its options together): drawn again
        index += 1
        config = d.config
        if rng.random() < 0.5 and by_type.get(config.get("model_type")):
            config = load_preset(rng.choice(by_type[config["model_type"]]))
        for j in range(per_layout):
            fields = dict(d.fields)
            if j:
                fields |= {"batch_size": rng.choice(BATCHES), "seq_len": rng.choice(SEQS)}
                if fields.get("pp", 1) > 1:  # the step's batch: a multiple of the microbatches
                    fields["batch_size"] *= fields.get("microbatches", 1)
            out.append({"config": config, "fields": fields})
    return out


def emit(path: str) -> None:
    """Estimate every plan of `path` in order; print one JSON line each."""
    from llmem.errors import InputError
    from llmem.estimate import estimate
    from llmem.plan import TrainingPlan
    from llmem.spec import ModelSpec

    specs: dict = {}
    for i, row in enumerate(json.load(open(path))):
        if i % 100 == 0:
            print(f"{i} plans", file=sys.stderr, flush=True)
        key = json.dumps(row["config"], sort_keys=True)
        try:
            spec = specs.get(key) or specs.setdefault(key, ModelSpec.from_config(row["config"]))
            est = estimate(spec, TrainingPlan(**row["fields"]))
            out = est.to_dict() | {"all_phases": [[p.name, {str(k): v for k, v in p.breakdown.items()}, p.total]
                                                   for p in est.phases]}
        except InputError as e:
            out = {"refused": [e.field, str(e)]}
        print(json.dumps(out, sort_keys=True), flush=True)
    if importlib.util.find_spec("llmem.walk.replay"):  # this tree: how many plans a record answered
        from llmem.walk.replay import STATS

        print(json.dumps({"replayed": STATS}), flush=True)


def run(trees: list[str], path: str) -> list[list[str]]:
    """Each tree's lines for the plans of `path`, the trees in processes of their own side by side."""
    outs = [f"{path}.{i}.jsonl" for i in range(len(trees))]
    # each tree traces with a disk cache of its own (a tree must not read the other's fitted tables)
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--emit", path], cwd=tree,
                              env=dict(os.environ, PYTHONPATH=tree, LLMEM_CACHE_DIR=f"{out}.cache"),
                              stdout=open(out, "w"))
             for tree, out in zip(trees, outs, strict=True)]
    if any(p.wait() for p in procs):
        raise SystemExit("a tree failed to estimate the plans (its traceback above)")
    return [open(out).read().splitlines() for out in outs]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--emit")
    ap.add_argument("--base")
    ap.add_argument("--layouts", type=int, default=600)
    ap.add_argument("--per-layout", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--derived", action="store_true")
    ap.add_argument("--plans", default="out/replay-plans.json")
    args = ap.parse_args()
    if args.emit:
        emit(args.emit)
        return 0
    os.makedirs(os.path.dirname(args.plans) or ".", exist_ok=True)
    with open(args.plans, "w") as f:
        json.dump(draw_plans(args.layouts, args.seed, args.derived, args.per_layout), f)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    new, old = run([here, os.path.abspath(args.base)], os.path.abspath(args.plans))
    stats = json.loads(new.pop())
    rows = json.load(open(args.plans))
    diffs = [i for i, (a, b) in enumerate(zip(new, old, strict=True)) if a != b]
    refused = sum('"refused"' in line for line in new)
    print(f"{len(new)} plans ({len(rows) // args.per_layout} layouts), {refused} refused by both trees, "
          f"{stats['replayed']['replayed']} answered by a compiled record; {len(diffs)} differences")
    print("traces:", {k: v for k, v in stats["replayed"].items() if k != "replayed"})
    for i in diffs[:20]:
        print(json.dumps(rows[i]["fields"]), "\n  new:", new[i][:300], "\n  old:", old[i][:300])
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
