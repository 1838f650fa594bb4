"""The CI sample of the random sweep: plans 0-11 of seed 19 (4 accepted by the estimator: two single-rank, two on 2
ranks in one torchrun job), measured for real on CPU; each within the bound of the measured suite rows (1%). (Seed 18's
first 12 plans, the sample before, grew to 6 accepted, two of them on 4 ranks, as more became modelled.)

A plan outside the bound is not tuned away here: it is marked xfail(strict=True) with its figures and reported."""

import pytest

from llmem.measure.validate import TOLERANCE_MULTI, TOLERANCE_SINGLE
from llmem.sweep.draw import draw
from llmem.sweep.run import COMPARED, base_record, estimate_draw, sweep

SEED, N = 19, 12
# Plans outside the bound, each with its figures: none today. (s18-2, gpt_neox DDP + adamw8bit with
# --ckpt-every 3, was +2.51%: the gelu MLPs' backward makes one intermediate-sized gradient, not two.)
KNOWN_OVER: dict[str, str] = {}


def accepted_ids() -> list[str]:
    """The plans of the sample the estimator accepts (torch-free: known when the tests are collected)."""
    ids = []
    for d in draw(N, SEED):
        rec = estimate_draw(d, base_record(d, SEED, "small", "measure"))
        if "outcome" not in rec:
            ids.append(rec["id"])
    return ids


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "sample.jsonl"
    rows = sweep(N, SEED, "measure", "small", out, block=N, log=lambda _: None)
    return {r["id"]: r for r in rows}


def test_the_sample_is_a_handful_of_single_and_multi_rank_plans():
    plans = {d.index: d.fields for d in draw(N, SEED)}
    ids = accepted_ids()
    assert 1 <= len(ids) <= 8
    assert {plans[int(i.split("-")[1])]["gpus"] for i in ids} >= {1, 2}


def test_every_plan_of_the_sample_has_a_row(measured):
    assert sorted(measured) == sorted(f"s{SEED}-{i}" for i in range(N))


@pytest.mark.parametrize("row_id", [
    pytest.param(i, marks=pytest.mark.xfail(strict=True, reason=KNOWN_OVER[i])) if i in KNOWN_OVER else i
    for i in accepted_ids()])
def test_measured_plan_within_the_suite_bound(measured, row_id):
    r = measured[row_id]
    assert r["outcome"] == COMPARED, r.get("reason")
    bound = 100 * (TOLERANCE_SINGLE if r["plan"]["gpus"] == 1 else TOLERANCE_MULTI)
    assert abs(r["error_pct"]) <= bound, (r["error_pct"], r["estimate_bytes"], r["oracle_bytes"], r["plan"])
