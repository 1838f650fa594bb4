"""Derived mixture-of-experts (`llmem.derive.experts`) on two CPU ranks (gloo, one torchrun launch): the scheme
terms — gradients, AdamW states, DDP's buckets and their rebuild, FSDP2's shards, gathers and reduce-scatters — on
the meta-device inventory, whose stacked experts are 3-D tensors (`experts.gate_up_proj`: E × 2i × h, FSDP2 shards
dim 0, the expert count). Against the measured max-over-ranks peak, within 1%. Heavy (one launch,
~2 min): `-m heavy`."""

import pytest

from tests.components.multirank import TwoRankRows
from tests.derive.configs import config

TOLERANCE = 0.01
_BASE = {"batch_size": 2, "seq_len": 64, "optimizer_impl": "forloop"}
ROWS = {f"{m}-{scheme}-{precision}-{ckpt}": {"gpus": 2, "zero": zero, "precision": precision, "grad_ckpt": ckpt,
                                               "attn": "eager" if m == "gpt_oss" else "sdpa"}
        for m in ("qwen3_moe", "deepseek_v3", "gpt_oss", "olmoe")
        for scheme, zero in (("ddp", 0), ("zero3", 3))
        for precision, ckpt in (("fp32", "none"), ("bf16-mixed", "full"))}
RUN = TwoRankRows(_BASE, ROWS, lambda name: config(name.split("-")[0]))


# FSDP2 mixed precision runs the layers in bf16; checkpointed in bf16, DeepSeek's layer backward is traced 1.5-1.8%
# above the measured peak (single rank too: deepseek_v2 / v3, bf16, full checkpointing), cause not found yet
ABOVE = {"deepseek_v3-zero3-bf16-mixed-full"}


@pytest.mark.heavy
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason="DeepSeek bf16 "
                                  "checkpointed backward traced above the measured peak")) if n in ABOVE else n
                                  for n in sorted(ROWS)])
def test_derived_moe_on_two_ranks_within_one_percent(name):
    RUN.check(name, TOLERANCE)
