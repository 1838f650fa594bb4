"""Sweep statistics on synthetic rows, against numbers worked out by hand."""

import pytest

from llmem.sweep import stats


def row(i, err=None, outcome="compared", reason="", kind=None, **plan):
    r = {"id": f"s0-{i}", "seed": 0, "index": i, "model": plan.pop("model", "llama-gqa"), "outcome": outcome,
         "plan": {"gpus": 1, "precision": "fp32", **plan}}
    if kind:
        r["kind"] = kind
    if err is not None:
        r |= {"error_pct": err, "estimate_bytes": 100, "oracle_bytes": 100}
    if reason:
        r["reason"] = reason
    return r


ROWS = [row(0, 0.2), row(1, -0.6, gpus=2), row(2, 1.5, gpus=2, precision="bf16"), row(3, -3.0, precision="bf16"),
        row(4, 0.0),
        row(5, outcome="refused by estimator", reason="tp: TP degree 4 must divide the GPU count 3; use 1",
            kind="refused"),
        row(6, outcome="refused by estimator", reason="tp: TP degree 2 must divide the GPU count 3; use 1",
            kind="refused"),
        row(7, outcome="refused by estimator", reason="quant: 'phi3' has no Linear named 'q_proj'"),
        row(8, outcome="refused by oracle", reason="attn: no sdpa for bloom"),
        row(9, outcome="failed", reason="RuntimeError: boom")]


def test_quantile_interpolates_between_ranks():
    assert stats.quantile([4, 1, 3, 2], 0.5) == 2.5
    assert stats.quantile([0, 10], 0.25) == 2.5
    assert stats.quantile([7], 0.99) == 7
    with pytest.raises(ValueError):
        stats.quantile([], 0.5)


def test_counts_every_outcome():
    assert stats.counts(ROWS) == {"drawn": 10, "compared": 5, "refused by estimator": 3, "refused by oracle": 1,
                                  "failed": 1, "accepted since, not run": 0}


def test_the_estimators_refusals_by_kind_rows_without_one_unclassified():
    assert stats.kinds(ROWS) == {"refused": 2, "gap": 0, "input": 0, "unclassified": 1}
    gap = row(10, outcome="refused by estimator", reason="method: not modelled for 'x'", kind="gap")
    assert stats.kinds([*ROWS, gap])["gap"] == 1
    assert [g["kind"] for g in stats.refusals([gap, *ROWS])["refused by estimator"]] == \
        ["refused", "gap", "unclassified"]


def test_distribution_of_the_compared_rows():
    d = stats.distribution(ROWS)
    # |errors| sorted: 0, 0.2, 0.6, 1.5, 3.0
    assert d["n"] == 5
    assert d["within"] == {0.5: 2 / 5, 1.0: 3 / 5, 2.0: 4 / 5}
    assert d["abs_quantiles"][0.5] == pytest.approx(0.6)
    assert d["abs_quantiles"][0.9] == pytest.approx(1.5 + 0.6 * 1.5)  # position 3.6
    assert d["max_abs"] == 3.0 and d["mean_abs"] == pytest.approx(5.3 / 5)
    assert (d["min"], d["max"], d["over"], d["under"]) == (-3.0, 1.5, 2, 2)
    assert stats.distribution(ROWS[5:]) == {"n": 0}


def test_a_bound_is_inclusive():
    assert stats.share_within([1.0, -1.0, 1.0001], 1.0) == 2 / 3


def test_worst_rows_by_absolute_error():
    assert [r["id"] for r in stats.worst(ROWS, 3)] == ["s0-3", "s0-2", "s0-1"]


def test_breakdown_by_option_value_worst_first():
    groups = {(g["option"], g["value"]): g for g in stats.breakdown(ROWS)}
    bf16 = groups[("precision", "bf16")]
    assert (bf16["n"], bf16["beyond"], bf16["worst"]) == (2, 2, -3.0)
    assert bf16["mean_abs"] == pytest.approx(2.25)
    two = groups[("gpus", "2")]
    assert (two["n"], two["beyond"], two["worst"]) == (2, 1, 1.5)
    fp32 = groups[("precision", "fp32")]
    assert (fp32["n"], fp32["beyond"], fp32["worst"]) == (3, 0, -0.6)
    assert groups[("model", "llama-gqa")]["n"] == 5
    assert two["beyond_share"] == 0.5 and groups[("gpus", "1")]["beyond_share"] == 1 / 3
    ranked = stats.breakdown(ROWS)
    assert (ranked[0]["option"], ranked[0]["value"]) == ("precision", "bf16")  # 2 of 2 beyond 1%
    assert (ranked[-1]["option"], ranked[-1]["value"]) == ("precision", "fp32")  # 0 of 3
    shares = [g["beyond_share"] for g in ranked]
    assert shares == sorted(shares, reverse=True)


def test_refusals_grouped_by_reason_without_the_numbers():
    r = stats.refusals(ROWS)
    assert r["refused by estimator"] == [
        {"reason": "tp: TP degree N must divide the GPU count N", "kind": "refused", "count": 2, "example": "s0-5"},
        {"reason": "quant: 'X' has no Linear named 'X'", "kind": "unclassified", "count": 1, "example": "s0-7"}]
    assert r["refused by oracle"] == [
        {"reason": "attn: no sdpa for bloom", "kind": "unclassified", "count": 1, "example": "s0-8"}]
    assert r["failed"] == [{"reason": "RuntimeError: boom", "kind": "unclassified", "count": 1, "example": "s0-9"}]


def test_reason_key_keeps_the_digits_of_names():
    assert stats.reason_key("optimizer: adamw8bit does not run on FSDP2 (ZeRO-2/3) with 4 GPUs; use fp16") == \
        "optimizer: adamw8bit does not run on FSDP2 (ZeRO-N/N) with N GPUs"
