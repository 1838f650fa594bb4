"""The reserved figures of the request-stream replay (`llmem.components.request_stream`), printed one JSON line a
plan, so that a change to its speed is shown to leave every figure the same to the byte:

    PYTHONPATH=. .venv/bin/python scripts/check_replay_identity.py > before.jsonl   # on the old tree
    PYTHONPATH=. .venv/bin/python scripts/check_replay_identity.py > after.jsonl    # on the new tree
    diff before.jsonl after.jsonl

Plans: scripts/check_reserved.py's rows; the plans of the sweep (`llmem.sweep.draw.draw_one`, cuda profile, small
and full size in turn) among its first `--draws` whose model is of a family the stream writes out (llama, mistral,
qwen2, qwen3); and as many plans moved into the replay's domain (`request_stream.covers`: the drawn
model, GPU count, batch, sequence and precision; one GPU, DDP, ZeRO-1 or TP). Each line: the plan, `Estimate.
reserved_bytes_range` (or the refusal), and where the stream covers the plan the replay itself with default and with
expandable segments. The last line counts the plans and the replayed ones.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def plans(draws: int, seed: int):
    """(name, config, fields) of every plan checked, in order."""
    from check_reserved import BASE, MODELS, SCHEMES

    from llmem.presets import load_preset
    from llmem.sweep.draw import draw_one

    for model in MODELS:
        for fields in SCHEMES.values():
            yield model, load_preset(model), {**BASE, **fields}
    for i in range(draws):
        d = draw_one(seed, i, ("small", "full")[i % 2], "cuda")
        if d.config.get("model_type") not in ("llama", "mistral", "qwen2", "qwen3"):
            continue  # a family the stream does not write out (the rules' figure, which this change leaves alone)
        yield d.model, d.config, d.fields
        rng = random.Random(f"identity:{seed}:{i}")
        gpus = d.fields["gpus"]
        layout = rng.choice(({"zero": 0}, {"zero": 1}, {"tp": gpus})) if gpus > 1 else {}
        precision = d.fields["precision"] if d.fields["precision"] in ("fp32", "bf16", "bf16-mixed") else "bf16-mixed"
        yield d.model, d.config, {"gpus": gpus, **layout, "batch_size": d.fields["batch_size"],
                                  "seq_len": d.fields["seq_len"], "precision": precision, "device": "cuda"}


_SPECS: dict = {}  # one spec per config: the plans of a model share its memo (the replay's layout stream)


def row(name: str, config: dict, fields: dict) -> dict:
    from llmem.components import request_stream
    from llmem.errors import InputError
    from llmem.estimate import estimate
    from llmem.plan import TrainingPlan
    from llmem.spec import ModelSpec

    out = {"model": name, "fields": fields}
    try:
        key = json.dumps(config, sort_keys=True)
        spec = _SPECS.get(key) or _SPECS.setdefault(key, ModelSpec.from_config(dict(config)))
        plan = TrainingPlan(**fields)
        out["range"] = list(estimate(spec, plan).reserved_bytes_range)
    except InputError as e:
        out["refused"] = str(e)
        return out
    out["replays"] = request_stream.replays(spec, plan)
    if request_stream.covers(spec, plan):
        out["replay"] = [request_stream.replayed_reserved_bytes(spec, plan, expandable) for expandable in (False, True)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draws", type=int, default=300)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    n = replayed = covered = 0
    for name, config, fields in plans(args.draws, args.seed):
        r = row(name, config, fields)
        n += 1
        replayed += bool(r.get("replays"))
        covered += "replay" in r
        print(json.dumps(r, sort_keys=True), flush=True)
    print(json.dumps({"plans": n, "replayed in the estimate": replayed, "covered (replay checked)": covered}))


if __name__ == "__main__":
    main()
