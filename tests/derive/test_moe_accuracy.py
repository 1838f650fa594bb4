"""Derived mixture-of-experts (`llmem.derive.experts`): the estimate against a real CPU run of one rank
(`measure_rank`, counting allocator), full fine-tuning, within 1%. The default suite runs one plan; the grid (every
derived MoE model type × fp32 / bf16-mixed × sdpa / eager × checkpointing none / full) is marked heavy
(`-m heavy`). gpt-oss has no sdpa path (eager only); checkpointed, its peak is a layer's recompute, started by
IndexBackward0 after ViewBackward0 made a tokens × top_k × h gradient (`llmem.derive.trace._trigger`, with the
recompute's CPU RNG state copy; 1.2 % below without them): `test_gpt_oss_checkpointed_recompute`. Known gap, on the
safe side: DeepSeek-V2/V3 in pure bf16 (and FSDP2 mixed precision, which runs the layers in bf16) with full
checkpointing, estimated 1.5-1.8% above the measured peak (`test_deepseek_bf16_checkpointed_gap`)."""

import itertools

import pytest

from llmem.derive.experts import DERIVED_MOE
from tests.derive.test_accuracy import _check

TOLERANCE = 0.01


@pytest.mark.parametrize("model_type, plan", [
    ("qwen3_moe", dict(batch_size=2, seq_len=64, precision="fp32", grad_ckpt="full")),
    pytest.param("qwen3_moe", dict(batch_size=2, seq_len=64, precision="bf16-mixed", grad_ckpt="full"),
                 marks=pytest.mark.heavy),
    pytest.param("deepseek_v3", dict(batch_size=3, seq_len=40, precision="fp32", attn="eager"),
                 marks=pytest.mark.heavy),
])
def test_derived_moe_estimate_within_one_percent(model_type, plan):
    _check(model_type, tolerance=TOLERANCE, **plan)


GRID = [(m, p, a, c) for m, p, a, c in itertools.product(DERIVED_MOE, ["fp32", "bf16-mixed"], ["sdpa", "eager"],
                                                         ["none", "full"]) if not (m == "gpt_oss" and a == "sdpa")]


@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16-mixed", marks=pytest.mark.heavy)])
def test_gpt_oss_checkpointed_recompute(precision):
    _check("gpt_oss", tolerance=TOLERANCE, batch_size=2, seq_len=64, precision=precision, attn="eager",
           grad_ckpt="full")


@pytest.mark.heavy
@pytest.mark.parametrize("model_type, precision, attn, ckpt", GRID)
def test_derived_moe_grid_within_one_percent(model_type, precision, attn, ckpt):
    _check(model_type, tolerance=TOLERANCE, batch_size=2, seq_len=64, precision=precision, attn=attn, grad_ckpt=ckpt)


@pytest.mark.heavy
@pytest.mark.xfail(strict=True, reason="DeepSeek bf16 checkpointed layer backward traced 1.8% above the measured peak")
@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
def test_deepseek_bf16_checkpointed_gap(model_type):
    _check(model_type, tolerance=TOLERANCE, batch_size=2, seq_len=64, precision="bf16", grad_ckpt="full")
