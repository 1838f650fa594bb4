"""`--gpus 1 --engine deepspeed --zero 0|1|2|3`: DeepSpeed 0.19.0 runs ZeRO over a data-parallel world of one (its
launcher's `--num_gpus 1`; the partitions are whole, ZeRO-3 gathers through `_no_gather_coalesced`,
partition_parameters.py:1449), which users run for its optimizer and offload paths. The same walks as on 2+ ranks
with W = 1; measured under a one-process torchrun launch (the variables DeepSpeed's own launcher sets), the
estimate within 1% of each peak."""

from __future__ import annotations

import importlib.util

import pytest

from tests.components.multirank import TwoRankRows
from tests.components.test_deepspeed import CONFIGS, SMALL
from tests.components.test_deepspeed_zero3 import AUTO

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="deepspeed is not installed (scripts/setup.sh installs it)")

ROWS = TwoRankRows({"gpus": 1, "batch_size": 1, "seq_len": 16, "engine": "deepspeed"}, {
    "llama-z2-bf16": {"zero": 2, "precision": "bf16-mixed", "ds_reduce_bucket": SMALL},
    "llama-z1-fp32": {"zero": 1, "precision": "fp32", "ds_reduce_bucket": SMALL},
    "llama-z3-fp32-auto": {"zero": 3, "precision": "fp32", **AUTO},
    "llama-z3-bf16-default": {"zero": 3, "precision": "bf16-mixed"},  # DeepSpeed's 5e8 bucket: 1 GB at the peak
    "llama-z2-fp32-default": {"zero": 2, "precision": "fp32"},
    "llama-z0-bf16": {"zero": 0, "precision": "bf16-mixed"},
    "llama-z0-fp32": {"zero": 0, "precision": "fp32"},
    "gpt2-z1-bf16-seq128": {"zero": 1, "precision": "bf16-mixed", "ds_reduce_bucket": 16_384, "seq_len": 128},
    "mistral-z3-bf16-auto-seq64": {"zero": 3, "precision": "bf16-mixed", **AUTO, "seq_len": 64},
}, lambda name: CONFIGS[name.split("-", 1)[0]], sampled=())  # by default: the suite's s-llama-deepspeed-* rows


@pytest.mark.parametrize("name", ROWS.params())  # -m heavy
def test_deepspeed_on_one_rank_within_1_percent_of_the_real_run(name):
    ROWS.check(name, tolerance=0.01)


def test_one_gpu_deepspeed_is_a_plan_and_other_engines_still_refuse_zero():
    from llmem.errors import InputError
    from llmem.plan import TrainingPlan

    for zero in (0, 1, 2, 3):
        assert TrainingPlan(gpus=1, zero=zero, engine="deepspeed").strategy_label == f"ZeRO-{zero} (DeepSpeed)"
    with pytest.raises(InputError) as e:
        TrainingPlan(gpus=1, zero=2, engine="torch")
    assert e.value.field == "zero"
