"""Closed-form estimate vs simulation for every preset up to a parameter limit under every strategy.

    python -m llmem.simulate.sweep [--max-params 8.1e9] [--out out/sweep.jsonl] [--markdown docs/...] [--only NAME]

Plan per row: DESIGN.md's defaults (micro-batch 1 × 2048, or the model's position limit if smaller; bf16-mixed,
AdamW, cuda profile) with the strategy's GPU count: single 1; DDP, ZeRO-1/2/3 on 8; TP 2 on 2; TP 2 × FSDP2 on 8
(families with a TP plan). Rows are appended to the JSONL as they finish, so an interrupted sweep keeps what it
did (`--resume`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from llmem.errors import InputError

STRATEGIES = {
    "single": {"gpus": 1},
    "ddp": {"gpus": 8},
    "zero1": {"gpus": 8, "zero": 1},
    "zero2": {"gpus": 8, "zero": 2},
    "zero3": {"gpus": 8, "zero": 3},
    "tp": {"gpus": 2, "tp": 2},
    "tp+zero3": {"gpus": 8, "tp": 2, "zero": 3},
}
TOLERANCE = 0.02


def rows(max_params: float, only: list[str] | None = None):
    from llmem import presets
    from llmem.spec import ModelSpec

    for info in presets.list_presets():
        if (only and info.name not in only) or not info.supported:
            continue
        config = presets.load_preset(info.name)
        spec = ModelSpec.from_config(config)
        if spec.total_params > max_params:
            continue
        yield info.name, config, spec


def compare_one(name: str, config: dict, spec, strategy: str, base: dict) -> dict:
    from llmem.estimate import estimate
    from llmem.plan import TrainingPlan
    from llmem.simulate import simulate

    rec = {"preset": name, "params": spec.total_params, "strategy": strategy}
    limit = config.get("n_positions") or config.get("max_position_embeddings") or base["seq_len"]
    base = {**base, "seq_len": min(base["seq_len"], int(limit))}  # gpt2: 1024 positions
    rec["seq_len"] = base["seq_len"]
    try:
        plan = TrainingPlan(**base, **STRATEGIES[strategy])
        est = estimate(spec, plan)
        simulate_attn_check(config, plan)
    except InputError as exc:
        if exc.field != "attn":
            return rec | {"status": "n/a", "message": str(exc)}
        plan = plan.with_(attn="eager")  # families without an sdpa path (bloom)
        est = estimate(spec, plan)
        rec["attn"] = "eager"
    try:
        t0 = time.perf_counter()
        sim = simulate(config, plan)
        seconds = time.perf_counter() - t0
    except InputError as exc:
        return rec | {"status": "n/a", "message": str(exc)}
    except Exception as exc:  # a strategy the simulation cannot run: recorded, the sweep goes on
        return rec | {"status": "failed", "message": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    err = (est.peak_bytes - sim.peak_bytes) / sim.peak_bytes
    return rec | {"status": "ok" if abs(err) <= TOLERANCE else "over", "estimate_bytes": est.peak_bytes,
                  "simulated_bytes": sim.peak_bytes, "error_pct": round(100 * err, 4),
                  "estimate_phase": est.peak_phase, "simulated_phase": f"{sim.peak_phase} {sim.peak_iteration}",
                  "reserved_bytes": sim.reserved_bytes, "estimate_reserved_bytes": est.reserved_bytes,
                  "closed_form": bool(sim.closed_form), "seconds": round(seconds, 2)}


def simulate_attn_check(config: dict, plan) -> None:
    """InputError("attn") when transformers has no such attention for the family (checked on the meta device)."""
    import torch

    from llmem.runtime import build_model

    small = {**config, "num_hidden_layers": 1, "n_layer": 1, "num_layers": 1}
    with torch.device("meta"):
        build_model(small, plan, "meta")


def markdown(records: list[dict]) -> str:
    lines = ["| preset | params | strategy | estimate GiB | simulated GiB | est − sim | estimate phase | "
             "simulated phase | sim reserved GiB | s |", "|" + "---|" * 10]
    for r in records:
        if r["status"] in ("ok", "over"):
            lines.append(f"| {r['preset']} | {r['params'] / 1e9:.2f} B | {r['strategy']}"
                         f"{' ¹' if r.get('closed_form') else ''} | {r['estimate_bytes'] / 2**30:.3f} | "
                         f"{r['simulated_bytes'] / 2**30:.3f} | {r['error_pct']:+.3f}% | {r['estimate_phase']} | "
                         f"{r['simulated_phase']} | {r['reserved_bytes'] / 2**30:.3f} | {r['seconds']:.1f} |")
        else:
            lines.append(f"| {r['preset']} | {r['params'] / 1e9:.2f} B | {r['strategy']} | | | {r['status']} | "
                         f"{r['message'][:80].replace('|', '/')} | | | |")
    ok = [r for r in records if r["status"] in ("ok", "over")]
    worst = max(ok, key=lambda r: abs(r["error_pct"])) if ok else None
    lines += ["", f"{len(ok)} compared, {sum(r['status'] == 'over' for r in ok)} beyond ±{100 * TOLERANCE:.0f}%"
              + (f"; largest difference {worst['error_pct']:+.3f}% ({worst['preset']}, {worst['strategy']})"
                 if worst else ""),
              "", "¹ DDP / ZeRO-1: gradient buckets from the closed-form model (they do not run under fake tensors)."]
    return "\n".join(lines)


def reestimate(path: Path, markdown_path: str | None) -> int:
    """Recompute the estimate of every compared row (the estimator changes more often than the runtime)."""
    from llmem.estimate import estimate
    from llmem.plan import TrainingPlan
    from llmem.presets import load_preset
    from llmem.spec import ModelSpec

    base = {"batch_size": 1, "precision": "bf16-mixed", "device": "cuda"}
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for r in records:
        if "simulated_bytes" not in r:
            continue
        spec = ModelSpec.from_config(load_preset(r["preset"]))
        plan = TrainingPlan(**base, seq_len=r["seq_len"], attn=r.get("attn", "sdpa"), **STRATEGIES[r["strategy"]])
        est = estimate(spec, plan)
        err = (est.peak_bytes - r["simulated_bytes"]) / r["simulated_bytes"]
        r.update(estimate_bytes=est.peak_bytes, estimate_phase=est.peak_phase, error_pct=round(100 * err, 4),
                 estimate_reserved_bytes=est.reserved_bytes, status="ok" if abs(err) <= TOLERANCE else "over")
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    table = markdown([r for r in records if r["status"] in ("ok", "over")])
    if markdown_path:
        Path(markdown_path).write_text(table + "\n")
    print(table)
    return 1 if any(r["status"] in ("over", "failed") for r in records) else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m llmem.simulate.sweep", description=__doc__.splitlines()[0])
    p.add_argument("--max-params", type=float, default=8.1e9)
    p.add_argument("--out", default="out/simulate-sweep.jsonl")
    p.add_argument("--markdown", default=None, help="also write the table to this markdown file")
    p.add_argument("--only", nargs="*", default=None, help="preset names")
    p.add_argument("--strategies", nargs="*", default=list(STRATEGIES))
    p.add_argument("--resume", action="store_true")
    p.add_argument("--reestimate", action="store_true",
                   help="keep the simulated figures of --out and recompute only the closed-form estimates")
    args = p.parse_args(argv)
    if args.reestimate:
        return reestimate(Path(args.out), args.markdown)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {}
    if args.resume and out.exists():
        for line in out.read_text().splitlines():
            r = json.loads(line)
            done[(r["preset"], r["strategy"])] = r
    elif out.exists():
        out.unlink()
    base = {"batch_size": 1, "seq_len": 2048, "precision": "bf16-mixed", "device": "cuda"}
    records = []
    for name, config, spec in rows(args.max_params, args.only):
        for strategy in args.strategies:
            rec = done.get((name, strategy))
            if rec is None:
                rec = compare_one(name, config, spec, strategy, base)
                with open(out, "a") as fh:
                    fh.write(json.dumps(rec) + "\n")
            records.append(rec)
            msg = (f"{rec['error_pct']:+.3f}% ({rec['seconds']:.1f} s)" if "error_pct" in rec
                   else f"{rec['status']}: {rec.get('message', '')[:100]}")
            print(f"{name:<28}{strategy:<10}{msg}", file=sys.stderr, flush=True)
    table = markdown(records)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    print(table)
    return 1 if any(r["status"] in ("over", "failed") for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
