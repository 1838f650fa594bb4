"""makefit: every change it offers fits (checked against `estimate` afresh), it offers none when the plan fits, the
ranking is the documented one, and the fewest GPUs is the fewest (one fewer does not fit)."""

import time

import pytest

from llmem import makefit
from llmem.compare import strategies
from llmem.estimate import estimate
from llmem.gpus import get_gpu
from llmem.plan import Method, Precision, TrainingPlan
from llmem.presets import load_preset
from llmem.spec import modelled_spec

SPEC = modelled_spec(load_preset("llama-3.1-8b"))
A100 = get_gpu("a100-80gb")


def fits(plan: TrainingPlan, capacity: int) -> bool:
    return estimate(SPEC, plan).device_total_bytes <= capacity


@pytest.mark.parametrize("plan, any_strategy", [
    (TrainingPlan(), True),
    (TrainingPlan(batch_size=2, seq_len=4096), True),  # b4: no single change fits (with the replayed reserved point)
    (TrainingPlan(gpus=8, zero=0, batch_size=2), False),
    (TrainingPlan(gpus=2, zero=1, batch_size=8, method="lora"), False),
])
def test_every_offered_change_fits_and_the_order_is_the_cheapest_first(plan, any_strategy):
    assert not makefit.fitting(SPEC, plan, A100.memory_bytes, any_strategy)
    fixes = makefit.make_fit(SPEC, plan, A100, any_strategy=any_strategy)
    assert fixes
    for fix in fixes:
        assert fits(fix.plan, fix.gpu.memory_bytes), fix.label
        assert fix.headroom_bytes >= 0 and fix.device_total_bytes == estimate(SPEC, fix.plan).device_total_bytes
        for name, value in fix.changes.items():
            if name != "gpu_type":
                assert getattr(fix.plan, name) == value, (fix.label, name)
    kinds = [f.kind for f in fixes]
    assert kinds == sorted(kinds, key=makefit.KINDS.index) and len(set(kinds)) == len(kinds)


def test_an_8b_full_plan_on_one_a100_is_offered_qlora_more_gpus_and_a_larger_gpu():
    fixes = {f.kind: f for f in makefit.make_fit(SPEC, TrainingPlan(), A100, any_strategy=True)}
    assert {"qlora", "more GPUs", "larger GPU"} <= set(fixes)
    qlora = fixes["qlora"].plan
    assert qlora.method is Method.QLORA and qlora.precision is Precision.BF16  # the compute dtype qlora needs
    assert fixes["larger GPU"].gpu.memory_bytes > A100.memory_bytes


def test_a_plan_that_fits_needs_no_change():
    assert makefit.make_fit(SPEC, TrainingPlan(method="lora", precision="bf16"), A100, any_strategy=True) == []


def test_the_fewest_gpus_is_the_fewest():
    plan = TrainingPlan(batch_size=2)
    n, fit_plan, est = makefit.min_gpus(SPEC, plan, A100.memory_bytes)
    assert n > 1 and fit_plan.gpus == n and est.device_total_bytes <= A100.memory_bytes
    fewer = makefit.on_gpus(plan, n - 1)
    assert all(not fits(p, A100.memory_bytes) for p in strategies(SPEC, fewer) if p.tp in (1, 2, 4, 8))


def test_checkpointing_picks_the_largest_k_that_fits():
    plan = TrainingPlan(gpus=8, zero=3, seq_len=8192, batch_size=2)
    fix = next(f for f in makefit.make_fit(SPEC, plan, A100) if f.kind == "checkpointing")
    k = fix.plan.ckpt_every
    assert fits(fix.plan, A100.memory_bytes)
    if k < SPEC.num_layers:
        assert not fits(fix.plan.with_(ckpt_every=k + 1), A100.memory_bytes)


def test_the_grid_has_one_row_per_count_and_headroom_per_gpu_type():
    rows = makefit.fit_grid(SPEC, TrainingPlan())
    assert [r["gpus"] for r in rows] == list(makefit.GRID_COUNTS)
    totals = [r["device_total_bytes"] for r in rows]
    assert totals == sorted(totals, reverse=True)  # more GPUs, less per GPU
    assert rows[0]["headroom"]["a100-80gb"] == A100.memory_bytes - totals[0]
    for row in rows:  # short where the headroom is negative; fits or risky (the high end decides) where it is not
        for key, headroom in row["headroom"].items():
            assert (row["verdict"][key] == "no") == (headroom < 0), (row["gpus"], key)
    assert {"fits", "no"} <= {v for row in rows for v in row["verdict"].values()}


def test_make_fit_is_fast_when_warm():
    plan = TrainingPlan(gpus=8, zero=0, batch_size=2)
    makefit.make_fit(SPEC, plan, A100)
    start = time.perf_counter()
    makefit.make_fit(SPEC, plan, A100)
    assert time.perf_counter() - start < 0.1
