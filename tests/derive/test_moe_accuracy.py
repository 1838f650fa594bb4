"""Derived mixture-of-experts (`llmem.derive.experts`): the estimate against a real CPU run of one rank
(`measure_rank`, counting allocator), full fine-tuning, within 1%. The default suite runs one plan; the grid (every
derived MoE model type × fp32 / bf16-mixed × sdpa / eager × checkpointing none / full) is marked heavy
(`-m heavy`). gpt-oss has no sdpa path (eager only). Known gap, below the measured peak: gpt-oss checkpointed
(fp32 and bf16-mixed) measures 1.2% above the estimate — its full-attention mask, held only by the odd layers'
checkpoints, is counted as released before layer 0's backward (`Derived.held_released_bytes`); without that
release the estimate was 0.7% below. Cause not found (`GPT_OSS_BELOW`, strict xfails). Known gap, on the
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


GPT_OSS_BELOW = {("gpt_oss", p, "eager", "full") for p in ("fp32", "bf16-mixed")}


@pytest.mark.heavy
@pytest.mark.parametrize("model_type, precision, attn, ckpt", [
    pytest.param(*row, marks=pytest.mark.xfail(strict=True, reason="gpt-oss checkpointed: measured 1.2% above"))
    if row in GPT_OSS_BELOW else row for row in GRID])
def test_derived_moe_grid_within_one_percent(model_type, precision, attn, ckpt):
    _check(model_type, tolerance=TOLERANCE, batch_size=2, seq_len=64, precision=precision, attn=attn, grad_ckpt=ckpt)


@pytest.mark.heavy
@pytest.mark.xfail(strict=True, reason="DeepSeek bf16 checkpointed layer backward traced 1.8% above the measured peak")
@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
def test_deepseek_bf16_checkpointed_gap(model_type):
    _check(model_type, tolerance=TOLERANCE, batch_size=2, seq_len=64, precision="bf16", grad_ckpt="full")
