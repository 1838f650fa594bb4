"""`--engine deepspeed --optimizer adafactor`: torch's Adafactor (`lr=1e-4, foreach=False`) as DeepSpeed's client
optimizer (`zero_allow_untested_optimizer`). ZeRO-1/2/3 hand it one 1-D fp32 partition, whose state is the unfactored
variance (no row / column factors below 2 dims) and whose step makes grad² and the variance's clone; ZeRO-0 steps
the module's own tensors (under bf16 FP16_UnfusedOptimizer's fp32 clones), the one-device program's factored states.
Real CPU runs on 2 ranks, the estimate within 1% of each peak (-m heavy; the suite's
d2-llama-deepspeed-zero2-bf16mix-adafactor by default)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.components.multirank import TwoRankRows
from tests.components.test_deepspeed import CONFIGS, SMALL
from tests.components.test_deepspeed_zero3 import AUTO

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="deepspeed is not installed (scripts/setup.sh installs it)")

ROWS = TwoRankRows({"gpus": 2, "batch_size": 1, "seq_len": 16, "engine": "deepspeed", "optimizer": "adafactor"}, {
    "llama-z1-fp32": {"zero": 1, "precision": "fp32", "ds_reduce_bucket": SMALL},
    "llama-z2-bf16": {"zero": 2, "precision": "bf16-mixed", "ds_reduce_bucket": SMALL},
    "llama-z3-fp32-auto": {"zero": 3, "precision": "fp32", **AUTO},
    "llama-z3-bf16-auto": {"zero": 3, "precision": "bf16-mixed", **AUTO},
    "llama-z0-bf16": {"zero": 0, "precision": "bf16-mixed"},
}, lambda name: CONFIGS[name.split("-", 1)[0]], sampled=())


@pytest.mark.parametrize("name", ROWS.params())  # -m heavy
def test_deepspeed_adafactor_within_1_percent_of_the_real_run(name):
    ROWS.check(name, tolerance=0.01)


def test_adafactor_is_a_deepspeed_plan_and_bitsandbytes_is_still_a_gap():
    from llmem.errors import GAP, InputError
    from llmem.plan import TrainingPlan

    for zero in (0, 1, 2, 3):
        TrainingPlan(gpus=2, zero=zero, engine="deepspeed", optimizer="adafactor")
    with pytest.raises(InputError) as e:
        TrainingPlan(gpus=2, zero=2, engine="deepspeed", optimizer="adamw8bit")
    assert e.value.kind == GAP
