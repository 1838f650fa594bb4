"""Every figure of `estimate` over a grid of models and plans, one JSON line a plan, so that a refactor is shown to
leave every estimate the same to the byte:

    PYTHONPATH=. .venv/bin/python scripts/check_estimate_identity.py > before.jsonl   # on the old tree
    PYTHONPATH=. .venv/bin/python scripts/check_estimate_identity.py > after.jsonl    # on the new tree
    diff before.jsonl after.jsonl

The grid: every preset the estimator models under a few plans (`PRESET_PLANS`; LoRA where its table is written,
not traced); the sweep's tiny configs of each hand-written family (`llmem.sweep.models.SMALL`) with variants of the
LayerNorm decoders' options (dropouts, OPT's projection, GPT-NeoX's parallel residual) under `SMALL_PLANS`, the other
families under every fifth of them; and the first `--draws` plans of the sweep (small and full size in turn, cpu and
cuda profiles). Each line: the model, the plan, `Estimate.to_dict()` with every phase's breakdown (or the refusal).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

PRESET_PLANS = (
    {"precision": "bf16-mixed", "grad_ckpt": "full", "batch_size": 1, "seq_len": 2048, "device": "cuda"},
    {"gpus": 8, "zero": 3, "precision": "bf16-mixed", "grad_ckpt": "full", "batch_size": 2, "seq_len": 4096,
     "device": "cuda"},
    {"gpus": 4, "tp": 4, "precision": "bf16", "batch_size": 1, "seq_len": 1024, "device": "cuda"},
    {"method": "lora", "precision": "bf16-mixed", "batch_size": 2, "seq_len": 512, "device": "cuda"},
    {"method": "qlora", "precision": "bf16-mixed", "grad_ckpt": "full", "batch_size": 1, "seq_len": 1024,
     "device": "cuda"},
    {"gpus": 2, "zero": 1, "precision": "fp32", "attn": "eager", "batch_size": 1, "seq_len": 256, "device": "cpu"},
)

VARIANTS = {  # the LayerNorm decoders' options the hand-written tables read
    "gpt2": ({}, {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}),
    "opt": ({}, {"word_embed_proj_dim": 32}, {"dropout": 0.0}),
    "gpt_neox": ({}, {"hidden_dropout": 0.1}, {"use_parallel_residual": False}, {"attention_dropout": 0.1}),
    "bloom": ({}, {"hidden_dropout": 0.1}),
    "falcon": ({}, {"new_decoder_architecture": True, "num_kv_heads": 2}),
}

SMALL_PLANS = [  # full fine-tuning: the hand-written tables' own moments
    {"precision": p, "attn": a, "batch_size": b, "seq_len": 64, "grad_ckpt": g, "device": d}
    for p, a, b, g, d in itertools.product(("fp32", "bf16-mixed", "bf16"), ("eager", "sdpa"), (1, 2),
                                           ("none", "full"), ("cpu", "cuda"))
]


def plans(draws: int, seed: int):
    """(name, config, fields) of every plan checked, in order."""
    from llmem.families import FAMILIES
    from llmem.presets import list_presets, load_preset
    from llmem.sweep.draw import draw_one
    from llmem.sweep.models import SMALL

    for info in list_presets():
        if info.supported:
            for fields in PRESET_PLANS:
                if fields.get("method", "full") == "full" or FAMILIES[info.model_type].lora_activations:
                    yield info.name, load_preset(info.name), fields  # (LoRA traced at full size: minutes)
    for name, config in SMALL.items():
        variants = VARIANTS.get(config["model_type"])
        for extra in variants or ({},):
            for fields in SMALL_PLANS if variants else SMALL_PLANS[::5]:
                yield f"{name}{extra}", {**config, **extra}, fields
    for i in range(draws):
        d = draw_one(seed, i, ("small", "full")[i % 2], ("cpu", "cuda")[i // 2 % 2])
        yield d.model, d.config, d.fields


_SPECS: dict = {}


def row(name: str, config: dict, fields: dict) -> dict:
    from llmem.errors import InputError
    from llmem.estimate import estimate
    from llmem.plan import TrainingPlan
    from llmem.spec import ModelSpec

    out = {"model": name, "fields": fields}
    try:
        key = json.dumps(config, sort_keys=True)
        spec = _SPECS.get(key) or _SPECS.setdefault(key, ModelSpec.from_config(dict(config)))
        est = estimate(spec, TrainingPlan(**fields))
        out["estimate"] = est.to_dict()
        out["phases"] = {p.name: {str(k): v for k, v in p.breakdown.items()} for p in est.phases}
    except InputError as e:
        out["refused"] = str(e)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draws", type=int, default=100)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--timing", action="store_true", help="each plan's time on stderr")
    args = ap.parse_args()
    n = refused = 0
    for name, config, fields in plans(args.draws, args.seed):
        t0 = time.perf_counter()
        r = row(name, config, fields)
        if args.timing:
            print(f"{time.perf_counter() - t0:7.3f} s {name} {fields}", file=sys.stderr)
        n += 1
        refused += "refused" in r
        print(json.dumps(r, sort_keys=True, default=str), flush=True)
    print(json.dumps({"plans": n, "refused": refused}))


if __name__ == "__main__":
    main()
