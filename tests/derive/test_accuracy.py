"""Derived architectures (outside the hand-written families): the estimate against a real CPU run of one rank
(`measure_rank`, counting allocator), full fine-tuning. The default suite runs a few plans; the grid (every family
here × fp32 / bf16-mixed / bf16 × sdpa / eager × checkpointing none / full) runs under -m heavy, its cover of
every family and every setting by default."""

import itertools

import pytest

from llmem.estimate import estimate
from llmem.measure.run import measure_rank
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from tests.derive.configs import EXTRA, config

TOLERANCE = 0.005


def _check(model_type: str, tolerance: float = TOLERANCE, **plan):
    cfg = config(model_type)
    p = TrainingPlan(device="cpu", **plan)
    est = estimate(ModelSpec.from_config(cfg), p)
    assert est.spec.derived is not None
    measured = measure_rank(cfg, p)["peak_bytes"]
    assert abs(est.peak_bytes - measured) <= tolerance * measured, f"{est.peak_bytes:,} vs {measured:,}"


@pytest.mark.parametrize("model_type, plan", [
    ("olmo2", dict(batch_size=2, seq_len=64, precision="bf16-mixed", grad_ckpt="full")),
    ("gemma3_text", dict(batch_size=1, seq_len=64, precision="fp32")),  # above the sliding window (32)
    ("starcoder2", dict(batch_size=2, seq_len=96, precision="bf16", attn="eager")),
])
def test_derived_estimate_within_half_a_percent(model_type, plan):
    _check(model_type, **plan)


SETTINGS = list(itertools.product(["fp32", "bf16-mixed", "bf16"], ["sdpa", "eager"], ["none", "full"]))
GRID = [(family, *setting) for family in sorted(EXTRA) for setting in SETTINGS]
# the default suite's cover (its time budget): every family once and every setting once, the rest under -m heavy
COVER = {(sorted(EXTRA)[i % len(EXTRA)], *SETTINGS[i]) for i in range(max(len(EXTRA), len(SETTINGS)))}


# checkpointed under autocast, glm4 eager read +1.87 % (6,111,220 vs 5,998,860 B) while the traced recompute moment
# (`Derived.recompute_extra_bytes`) counted all the layer's weight copies, -0.005 % with those made by its peak
# (`trace._forwards`). (stablelm, whose layer 0's recompute is its peak, read 1.0% / 0.9% below before the
# recompute's trigger, the half cast of the output gradient, and its CPU RNG state copy were counted: -0.001% /
# -0.002% now.)


def _marks(row: tuple) -> list:
    return [] if row in COVER else [pytest.mark.heavy]


@pytest.mark.slow
@pytest.mark.parametrize("model_type, precision, attn, ckpt", [pytest.param(*row, marks=_marks(row)) for row in GRID])
def test_derived_grid_within_half_a_percent(model_type, precision, attn, ckpt):
    _check(model_type, batch_size=2, seq_len=64, precision=precision, attn=attn, grad_ckpt=ckpt)
