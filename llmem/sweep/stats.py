"""Statistics of a sweep's rows (pure): error distribution, per-option breakdown, worst cases, refusals by reason.

A row is a dict as `llmem.sweep.run` writes it: `outcome` (compared / refused by estimator / refused by oracle /
failed), `plan` (TrainingPlan keywords), and for compared rows `error_pct` = 100 (estimate − oracle) / oracle.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict

COMPARED = "compared"
OUTCOMES = (COMPARED, "refused by estimator", "refused by oracle", "failed", "accepted since, not run")
# Why the estimator refused (`InputError.kind`); rows of sweeps before kinds were recorded are "unclassified".
KINDS = {"refused": "right refusals (the real program cannot run)", "gap": "gaps (not modelled yet)",
         "input": "malformed or out-of-range input", "unclassified": "unclassified (re-render with --reestimate)"}
BOUNDS_PCT = (0.5, 1.0, 2.0)
QUANTILES = (0.5, 0.9, 0.95, 0.99)
# Plan options broken down (the model is broken down by name).
OPTIONS = ("gpus", "tp", "zero", "precision", "optimizer", "optimizer_impl", "grad_ckpt", "ckpt_every", "attn",
           "method", "quant", "lora_targets", "lora_modules_to_save", "grad_accum", "batch_size", "seq_len")


def errors(rows: list[dict]) -> list[float]:
    return [float(r["error_pct"]) for r in rows if r.get("outcome") == COMPARED]


def quantile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default), on a sorted copy."""
    if not values:
        raise ValueError("quantile of no values")
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def share_within(errs: list[float], bound_pct: float) -> float:
    return sum(abs(e) <= bound_pct for e in errs) / len(errs) if errs else 0.0


def counts(rows: list[dict]) -> dict[str, int]:
    """Rows per outcome (every outcome listed, zero included), and `drawn`."""
    c = Counter(r.get("outcome") for r in rows)
    return {"drawn": len(rows), **{o: c.get(o, 0) for o in OUTCOMES}}


def distribution(rows: list[dict]) -> dict:
    """Of the compared rows: count, share within each bound, quantiles of |error|, mean |error|, signed extremes."""
    errs = errors(rows)
    if not errs:
        return {"n": 0}
    absolute = [abs(e) for e in errs]
    return {"n": len(errs),
            "within": {b: share_within(errs, b) for b in BOUNDS_PCT},
            "abs_quantiles": {q: quantile(absolute, q) for q in QUANTILES},
            "max_abs": max(absolute), "mean_abs": sum(absolute) / len(absolute),
            "min": min(errs), "max": max(errs),
            "over": sum(e > 0 for e in errs), "under": sum(e < 0 for e in errs)}


def option_value(row: dict, option: str) -> str:
    if option == "model":
        return str(row.get("model", ""))
    value = row.get("plan", {}).get(option)
    return "" if value is None else str(value)


def breakdown(rows: list[dict], options=("model", *OPTIONS), bound_pct: float = 1.0) -> list[dict]:
    """Per option value over the compared rows: n, rows beyond `bound_pct` and their share, mean and worst |error| —
    sorted where the errors concentrate first: largest share beyond the bound, then largest |error|."""
    groups: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in rows:
        if r.get("outcome") != COMPARED:
            continue
        for option in options:
            groups[(option, option_value(r, option))].append(float(r["error_pct"]))
    out = []
    for (option, value), errs in groups.items():
        worst = max(errs, key=abs)
        beyond = sum(abs(e) > bound_pct for e in errs)
        out.append({"option": option, "value": value, "n": len(errs), "beyond": beyond,
                    "beyond_share": beyond / len(errs), "mean_abs": sum(map(abs, errs)) / len(errs), "worst": worst})
    out.sort(key=lambda g: (-g["beyond_share"], -abs(g["worst"]), g["option"], g["value"]))
    return out


def worst(rows: list[dict], k: int = 15) -> list[dict]:
    """The k compared rows with the largest |error| (ties: the lower id first)."""
    ok = [r for r in rows if r.get("outcome") == COMPARED]
    return sorted(ok, key=lambda r: (-abs(float(r["error_pct"])), r.get("seed", 0), r.get("index", 0)))[:k]


def reason_key(reason: str) -> str:
    """A refusal's reason without what varies between plans: numbers standing alone become N (not the digits of a
    name such as fp16 or adamw8bit), quoted names 'X', and only the first clause (up to the first ';') is kept."""
    text = reason.split(";", 1)[0].strip()
    text = re.sub(r"'[^']*'", "'X'", text)
    return re.sub(r"\b\d+(\.\d+)?\b", "N", text)


def refusals(rows: list[dict]) -> dict[str, list[dict]]:
    """Outcome -> [{reason, count, example id, kind}] for every outcome but compared, most frequent reason first
    (the estimator's refusals by kind: right refusals, then gaps)."""
    order = list(KINDS)
    out = {}
    for outcome in OUTCOMES[1:]:
        groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
        for r in rows:
            if r.get("outcome") == outcome:
                groups[(kind_of(r), reason_key(str(r.get("reason", ""))))].append(r)
        out[outcome] = sorted(({"reason": k[1], "kind": k[0], "count": len(v), "example": v[0].get("id", "")}
                               for k, v in groups.items()),
                              key=lambda g: (order.index(g["kind"]), -g["count"], g["reason"]))
    return out


def kind_of(row: dict) -> str:
    return row.get("kind") or "unclassified"


def kinds(rows: list[dict]) -> dict[str, int]:
    """The estimator's refusals per kind (every kind listed, zero included)."""
    c = Counter(kind_of(r) for r in rows if r.get("outcome") == OUTCOMES[1])
    return {k: c.get(k, 0) for k in KINDS}
