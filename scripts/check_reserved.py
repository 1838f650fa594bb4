"""`estimate`'s reserved figures against `simulate`'s caching-allocator replay at full size: the program built in full
on the device (both allocator settings) and the point program (the cache emptied after wrapping).

    PYTHONPATH=. .venv/bin/python scripts/check_reserved.py [--cache out/check_reserved.jsonl] [--only MODEL ...]
        [--scheme SCHEME ...]
        [--markdown FILE]

Rows: the models of docs/notes/2026-11-26-reserved-model.md × the schemes of llmem/simulate/sweep.py (single, DDP,
ZeRO-1/2/3 on 8, TP 2, TP 2 × FSDP2 on 8), micro-batch 1 × 2048, bf16-mixed, AdamW; for some models (`FOR`) also
ZeRO-3 and one GPU with full checkpointing, one GPU and DDP with selective checkpointing, one GPU in fp32 and TP 2
in pure bf16; and for llama-3.1-8b the checkpointed programs of docs/notes/2026-11-28-reserved-ckpt-streams.md
(every 2nd layer, under TP, in fp32 and pure bf16, selective under ZeRO-3). `simulate` takes 10–60 s a row at
full size, so its figures (peak, `max_memory_reserved` with default and with expandable segments) are kept in the
cache (JSON lines, one per row) and reused; the estimate is computed afresh each run. Prints one table row per
plan and the distribution of est − sim for each setting.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

MODELS = ["qwen2.5-1.5b", "qwen3-4b", "mistral-7b-v0.3", "llama-3.1-8b"]
SCHEMES = {
    "single": {}, "ddp": {"gpus": 8}, "zero1": {"gpus": 8, "zero": 1}, "zero2": {"gpus": 8, "zero": 2},
    "zero3": {"gpus": 8, "zero": 3}, "tp": {"gpus": 2, "tp": 2}, "tp+zero3": {"gpus": 8, "tp": 2, "zero": 3},
    "zero3 ckpt": {"gpus": 8, "zero": 3, "grad_ckpt": "full"},
    "single ckpt": {"grad_ckpt": "full"}, "single sel": {"grad_ckpt": "selective"},
    "ddp sel": {"gpus": 8, "grad_ckpt": "selective"}, "single fp32": {"precision": "fp32"},
    "tp bf16": {"gpus": 2, "tp": 2, "precision": "bf16"},
    # checkpointing the request stream did not write out (issue 15's flat-rule programs)
    "single ckpt2": {"grad_ckpt": "full", "ckpt_every": 2},
    "ddp ckpt2": {"gpus": 8, "grad_ckpt": "full", "ckpt_every": 2},
    "tp ckpt": {"gpus": 2, "tp": 2, "grad_ckpt": "full"},
    "tp ckpt2": {"gpus": 2, "tp": 2, "grad_ckpt": "full", "ckpt_every": 2},
    "single ckpt fp32": {"grad_ckpt": "full", "precision": "fp32"},
    "single ckpt bf16": {"grad_ckpt": "full", "precision": "bf16"},
    "ddp ckpt bf16": {"gpus": 8, "grad_ckpt": "full", "precision": "bf16"},
    "zero3 sel": {"gpus": 8, "zero": 3, "grad_ckpt": "selective"},
    # FSDP1 (FullyShardedDataParallel FULL_SHARD as accelerate configures it): its unshard, pre-unshard and
    # post-backward streams
    "fsdp1": {"gpus": 8, "zero": 3, "engine": "fsdp1"},
    "fsdp1 ckpt bf16": {"gpus": 4, "zero": 3, "engine": "fsdp1", "grad_ckpt": "full", "precision": "bf16"},
}
# schemes simulated for some models only (minutes a row at full size)
FOR = {"zero3 ckpt": ["llama-3.1-8b"],
       "single sel": ["qwen2.5-1.5b", "llama-3.1-8b"], "ddp sel": ["qwen3-4b"], "single fp32": ["qwen3-4b"],
       "tp bf16": ["qwen2.5-1.5b", "llama-3.1-8b"],
       **{k: ["qwen2.5-1.5b", "llama-3.1-8b"] for k in ("single ckpt fp32", "ddp ckpt bf16")},
       "single ckpt2": ["qwen2.5-1.5b", "mistral-7b-v0.3", "llama-3.1-8b"],
       "ddp ckpt2": ["qwen2.5-1.5b", "qwen3-4b", "llama-3.1-8b"],
       "tp ckpt": ["qwen2.5-1.5b", "mistral-7b-v0.3", "llama-3.1-8b"],
       "tp ckpt2": ["qwen2.5-1.5b", "qwen3-4b", "llama-3.1-8b"],
       "single ckpt bf16": ["qwen2.5-1.5b", "qwen3-4b", "llama-3.1-8b"], "zero3 sel": MODELS,
       "fsdp1 ckpt bf16": ["qwen2.5-1.5b", "llama-3.1-8b"]}
BASE = {"batch_size": 1, "seq_len": 2048, "precision": "bf16-mixed"}
GIB = 1 << 30


def row_names(only: list[str] | None, schemes: list[str] | None = None):
    for model in MODELS:
        if only and model not in only:
            continue
        for scheme in SCHEMES:
            if model not in FOR.get(scheme, [model]) or (schemes and scheme not in schemes):
                continue
            yield model, scheme


def simulated(model: str, scheme: str, cache: Path) -> dict:
    """The row's simulated figures, from the cache or simulated now (and appended to the cache)."""
    if cache.exists():
        for line in cache.read_text().splitlines():
            r = json.loads(line)
            if (r["model"], r["scheme"]) == (model, scheme):
                return r
    from llmem.plan import TrainingPlan
    from llmem.presets import load_preset
    from llmem.simulate import simulate

    sim = simulate(load_preset(model), TrainingPlan(**(BASE | SCHEMES[scheme])))
    r = {"model": model, "scheme": scheme, "peak": sim.peak_bytes, "reserved": sim.reserved_bytes,
         "expandable": sim.reserved_expandable_bytes, "at_reset": sim.reserved_at_reset_bytes,
         "emptied": sim.reserved_emptied_bytes}
    cache.parent.mkdir(parents=True, exist_ok=True)
    with cache.open("a") as fh:
        fh.write(json.dumps(r) + "\n")
    return r


def estimated(model: str, scheme: str) -> tuple[int, int, int, int]:
    """(peak, reserved of the program built in full on the device, the same with --alloc-conf expandable-segments,
    the point figure: the program with the cache emptied after wrapping). The range is the two programs' figures."""
    from llmem.components import reserved
    from llmem.estimate import estimate
    from llmem.plan import TrainingPlan
    from llmem.presets import load_preset
    from llmem.spec import ModelSpec

    spec = ModelSpec.from_config(load_preset(model))
    plan = TrainingPlan(**(BASE | SCHEMES[scheme]))
    est = estimate(spec, plan)
    built = reserved.reserved_bytes(est.spec, plan, est.phases, next(p for p in est.phases if p.name == est.peak_phase))
    exp = estimate(spec, plan.with_(alloc_conf="expandable-segments"))
    return est.peak_bytes, built, exp.reserved_bytes_range[1], est.reserved_bytes


def table(rows: list[tuple]) -> str:
    lines = ["| model | scheme | peak sim | built est | sim | est − sim | point est | emptied sim | est − sim | "
             "expandable est | sim | est − sim |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for model, scheme, sim, est in rows:
        d, e, p = est[1] / sim["reserved"] - 1, est[2] / sim["expandable"] - 1, est[3] / sim["emptied"] - 1
        lines.append(f"| {model} | {scheme} | {sim['peak'] / GIB:.2f} | {est[1] / GIB:.2f} | "
                     f"{sim['reserved'] / GIB:.2f} | {100 * d:+.1f}% | {est[3] / GIB:.2f} | "
                     f"{sim['emptied'] / GIB:.2f} | {100 * p:+.1f}% | {est[2] / GIB:.2f} | "
                     f"{sim['expandable'] / GIB:.2f} | {100 * e:+.1f}% |")
    for label, i, key in (("built in full, default segments", 1, "reserved"),
                          ("point (cache emptied after wrapping), default segments", 3, "emptied"),
                          ("expandable segments", 2, "expandable")):
        errs = [100 * (est[i] / sim[key] - 1) for _, _, sim, est in rows]
        if errs:
            absd = sorted(abs(e) for e in errs)
            lines.append(f"\n{label}: {len(errs)} rows, {sum(a <= 3 for a in absd)} within 3 %, median |err| "
                         f"{statistics.median(absd):.1f} %, worst {max(errs, key=abs):+.1f} %, "
                         f"range {min(errs):+.1f} … {max(errs):+.1f} %")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache", default="out/check_reserved.jsonl")
    p.add_argument("--only", nargs="*", default=None, help="model presets")
    p.add_argument("--scheme", nargs="*", default=None, help="schemes (keys of SCHEMES)")
    p.add_argument("--markdown", default=None, help="also write the table to this file")
    args = p.parse_args(argv)
    rows = []
    for model, scheme in row_names(args.only, args.scheme):
        sim = simulated(model, scheme, Path(args.cache))
        rows.append((model, scheme, sim, estimated(model, scheme)))
        print(f"{model:<18}{scheme:<12}done", file=sys.stderr, flush=True)
    out = table(rows)
    if args.markdown:
        Path(args.markdown).write_text(out + "\n")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
