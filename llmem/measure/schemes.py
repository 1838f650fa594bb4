"""ACCURACY.md's per-scheme table: each validated row counted once, torch's programs by scheme, FSDP1's by its
sharding strategy and DeepSpeed's by its stage (`--engine`)."""

from __future__ import annotations

from llmem.plan import FSDP1_LABELS, Scheme


def scheme_summary(records: list[dict]) -> list[dict]:
    """Per scheme: rows, rows compared, mean absolute and worst signed error (%)."""
    out = []
    groups = [(s, e, None) for s in Scheme for e in ("torch", "fsdp1")]  # FSDP1 and DeepSpeed rows apart (--engine)
    groups += [(None, "deepspeed", z) for z in range(4)]  # DeepSpeed by its stage (one rank is ZeRO-N too)
    for scheme, engine, zero in groups:
        rows = [r for r in records if str(r.get("engine") or "torch") == engine
                and (r["scheme"] == scheme.value if scheme else int(r["zero"]) == zero)]
        errs = [r["error_pct"] for r in rows if r["error_pct"] is not None]
        if not rows:
            continue
        label = FSDP1_LABELS.get(scheme, scheme.label) if engine == "fsdp1" else scheme.label if scheme else \
            f"ZeRO-{zero} (DeepSpeed)"
        out.append({"scheme": scheme.value if scheme else f"deepspeed-zero{zero}", "label": label, "rows": len(rows),
                    "compared": len(errs),
                    "failed": sum(r["status"] == "failed" for r in rows),
                    "mae_pct": round(sum(map(abs, errs)) / len(errs), 3) if errs else None,
                    "worst_pct": max(errs, key=abs) if errs else None})
    return out
