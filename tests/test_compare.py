"""compare(): valid strategies, the solved max micro-batch checked against direct estimates, the recommendation."""

import pytest

from llmem.compare import compare, max_batch_size, strategies
from llmem.estimate import estimate
from llmem.gpus import get_gpu
from llmem.plan import Scheme, TrainingPlan
from llmem.presets import load_preset
from llmem.spec import ModelSpec

SPEC = ModelSpec.from_config(load_preset("llama-3.1-8b"))


def test_strategies_for_eight_gpus_cover_the_design_table():
    schemes = {(p.scheme, p.tp) for p in strategies(SPEC, TrainingPlan(gpus=8))}
    assert schemes == {(Scheme.DDP, 1), (Scheme.ZERO1, 1), (Scheme.ZERO2, 1), (Scheme.ZERO3, 1),
                       (Scheme.TP_ZERO3, 2), (Scheme.TP_ZERO3, 4), (Scheme.TP, 8)}


def test_tp_degrees_that_do_not_divide_the_heads_are_left_out():
    spec = ModelSpec.from_config({"model_type": "llama", "num_attention_heads": 12, "num_key_value_heads": 4,
                                  "hidden_size": 768, "intermediate_size": 3072})
    tps = {p.tp for p in strategies(spec, TrainingPlan(gpus=8))}
    assert tps == {1, 2, 4}  # 8 does not divide 12 heads


def test_fused_qkv_families_get_no_tp_rows():
    spec = ModelSpec.from_config(load_preset("gpt2"))
    assert {p.tp for p in strategies(spec, TrainingPlan(gpus=4))} == {1}


@pytest.mark.parametrize("gpu", ["a100-80gb", "rtx-4090", "h100-80gb"])
@pytest.mark.parametrize("gpus,seq", [(1, 512), (8, 4096), (64, 2048)])
def test_max_batch_is_the_largest_that_fits(gpu, gpus, seq):
    """Independent check of the solver: the batch it returns fits by direct estimate and one more does not."""
    capacity = get_gpu(gpu).memory_bytes
    for plan in strategies(SPEC, TrainingPlan(gpus=gpus, seq_len=seq)):
        b = max_batch_size(SPEC, plan, capacity)
        if b:
            assert estimate(SPEC, plan.with_(batch_size=b)).device_total_bytes <= capacity
        assert estimate(SPEC, plan.with_(batch_size=b + 1)).device_total_bytes > capacity


def test_recommendation_fits_and_maximises_tokens():
    result = compare(SPEC, TrainingPlan(gpus=8, seq_len=2048), get_gpu("a100-80gb").memory_bytes)
    rec = result.recommended
    assert rec is not None and rec.fits
    assert all(rec.tokens_per_step >= r.tokens_per_step for r in result.rows if r.fits)
    assert rec.label in result.reason
    frame = result.to_frame()
    assert len(frame) == len(result.rows) and frame["recommended"].sum() == 1


def test_nothing_fits_says_by_how_much():
    result = compare(SPEC, TrainingPlan(gpus=1), get_gpu("t4").memory_bytes)
    assert result.recommended is None
    assert "short by" in result.reason and "GiB" in result.reason
