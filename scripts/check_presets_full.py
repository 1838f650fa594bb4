"""Every preset the estimator accepts, at full size, against `simulate` (fake tensors, the cuda profile).

    python scripts/check_presets_full.py [--names a,b,...] [--markdown FILE]

The plan: bf16-mixed AdamW, sdpa (eager for eager-only families), full checkpointing, batch 1 × 2048 — on one GPU
for models up to 8B parameters, else the rank of an 8-way ZeRO-3 job. Prints one row per preset (estimate,
simulate, error) and writes a markdown table if asked. A preset the estimator refuses is listed with its one line.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmem.errors import InputError  # noqa: E402
from llmem.estimate import estimate  # noqa: E402
from llmem.plan import TrainingPlan  # noqa: E402
from llmem.presets import list_presets, load_preset  # noqa: E402
from llmem.spec import ModelSpec  # noqa: E402

SINGLE_GPU_MAX_PARAMS = 8.5e9


def plan_for(spec: ModelSpec) -> TrainingPlan:
    big = spec.total_params > SINGLE_GPU_MAX_PARAMS
    return TrainingPlan(gpus=8 if big else 1, zero=3 if big else 0, precision="bf16-mixed", grad_ckpt="full",
                        batch_size=1, seq_len=2048, device="cuda")


def check(name: str) -> dict:
    from llmem.simulate import simulate

    config = load_preset(name)
    t0 = time.perf_counter()
    try:
        spec = ModelSpec.from_config(config)
        plan = plan_for(spec)
        try:
            est = estimate(spec, plan)
        except InputError as e:
            if e.field != "attn":
                raise
            plan = plan.with_(attn="eager")
            est = estimate(spec, plan)
        sim = simulate(config, plan)
    except InputError as e:
        return {"name": name, "refused": str(e)}
    error = (est.peak_bytes - sim.peak_bytes) / sim.peak_bytes
    return {"name": name, "scheme": "zero3 x8" if plan.zero == 3 else "single", "attn": str(plan.attn),
            "derived": spec.derived is not None, "estimate": est.peak_bytes, "simulate": sim.peak_bytes,
            "error": error, "seconds": time.perf_counter() - t0}


def markdown(rows: list[dict]) -> str:
    lines = ["| preset | path | plan | estimate GiB | simulate GiB | error |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "refused" in r:
            lines.append(f"| {r['name']} | refused | | | | {r['refused']} |")
            continue
        lines.append(f"| {r['name']} | {'derived' if r['derived'] else 'family'} | {r['scheme']}, {r['attn']} | "
                     f"{r['estimate'] / 2**30:.3f} | {r['simulate'] / 2**30:.3f} | {100 * r['error']:+.3f}% |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--names", help="comma-separated preset names (default: every preset)")
    parser.add_argument("--markdown", help="write the table to this file")
    args = parser.parse_args()
    names = args.names.split(",") if args.names else [p.name for p in list_presets()]
    rows = []
    for name in names:
        rows.append(check(name))
        r = rows[-1]
        shown = r["refused"] if "refused" in r else f"{100 * r['error']:+.3f}%  ({r['seconds']:.0f} s)"
        print(f"{name:32s} {shown}", flush=True)
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows))


if __name__ == "__main__":
    main()
