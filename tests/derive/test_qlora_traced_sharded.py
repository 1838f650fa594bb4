"""QLoRA on traced families under ZeRO-1 and FSDP2 (ZeRO-2/3), docs/MODEL-QLORA-SHARDED.md: the traced program is
one rank's, the walk of each scheme adds its sharding as it does for a hand-written family (FSDP2 leaves the packed
uint8 codes as they are: `FSDPParam.init_dtype_attrs` casts floating-point parameters only, torch 2.13
`_fully_shard/_fsdp_param.py:597`). Estimate against the max-over-ranks peak of a 2-rank gloo run within 1 %: one row
gap with `-m heavy` (a 2-rank launch costs more than the default run's 10 s per test); by default, what the
estimate answers and the bytes FSDP2's policy casts, against transformers' model on the meta device."""

from __future__ import annotations

import pytest

from llmem.estimate import estimate
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from tests.components.multirank import TwoRankRows
from tests.derive.test_lora_derived import config_of
from tests.derive.test_qlora_traced import row_config

TOLERANCE = 0.01
_BASE = dict(method="qlora", quant="nf4", lora_targets="all-linear", batch_size=2, seq_len=64, precision="fp32",
             gpus=2)

# ZeRO-1 / FSDP2 over a traced 4-bit base (and ZeRO-1 over an 8-bit one); '-wide': the layers' moments, a
# dequantized weight among them, set the peak
SHARDED = TwoRankRows(_BASE, {
    "olmo2-zero1": dict(zero=1),
    "gpt_neox-zero3": dict(zero=3),
    "gpt_neox-wide-zero1": dict(zero=1),
    "gpt_neox-wide-zero3": dict(zero=3),
    "phi-wide-zero2-bf16": dict(zero=2, precision="bf16"),
    "phi-wide-zero1-bf16-ckpt": dict(zero=1, precision="bf16", grad_ckpt="full"),
    "gpt_neox-wide-zero3-bf16-ckpt": dict(zero=3, precision="bf16", grad_ckpt="full"),
    "starcoder2-wide-zero2-dq": dict(zero=2, double_quant=True),
    "gpt_neox-wide-zero1-int8": dict(zero=1, quant="int8"),
    "olmo2-zero1-int8-bf16": dict(zero=1, quant="int8", precision="bf16"),
    "qwen3_moe-zero3-bf16": dict(zero=3, precision="bf16", lora_dropout=0.0),
    "phi-wide-zero1-bf16mix": dict(zero=1, precision="bf16-mixed"),
}, row_config, sampled=())


@pytest.mark.parametrize("name", SHARDED.params())
def test_traced_qlora_sharded_within_one_percent(name):
    SHARDED.check(name, TOLERANCE)


# FSDP2's MixedPrecisionPolicy(param_dtype=half, reduce_dtype=fp32) over a 4-bit base (traced and hand-written): the
# fp32 norms, embeddings and adapters all-gathered cast to half, the codes gathered as uint8, no autocast
MIXED = TwoRankRows(dict(_BASE, precision="bf16-mixed"), {
    "olmo2-zero3": dict(zero=3),
    "phi-wide-zero2": dict(zero=2),
    "gpt_neox-wide-zero3": dict(zero=3),
    "gpt_neox-wide-zero2-fp16mix": dict(zero=2, precision="fp16-mixed"),
    "phi-wide-zero3-ckpt": dict(zero=3, grad_ckpt="full"),
    "olmo2-zero2-ckpt-dq": dict(zero=2, grad_ckpt="full", double_quant=True),
    "llama-zero2": dict(zero=2),
    "llama-zero2-fp4": dict(zero=2, quant="fp4"),
    "llama-zero3-qv-ckpt": dict(zero=3, lora_targets="q_proj,v_proj", grad_ckpt="full"),
    "qwen3_moe-zero3": dict(zero=3, lora_dropout=0.0),
}, row_config, sampled=())


@pytest.mark.parametrize("name", MIXED.params())
def test_qlora_fsdp2_mixed_precision_within_one_percent(name):
    MIXED.check(name, TOLERANCE)


@pytest.mark.heavy  # (the trace: ~10-20 s)
def test_traced_qlora_under_fsdp2_is_estimated():
    """The traced tables answer FSDP2 over a traced 4-bit base, and a rank holds less of the base than the whole
    quantized base (the packed codes sharded; ZeRO-1 and the rows' figures: the two-rank tests above)."""
    from llmem.components import quant

    spec = ModelSpec.from_config(config_of("olmo2"))
    plan = TrainingPlan(**{**_BASE, "zero": 3, "device": "cpu"})
    est = estimate(spec, plan)
    assert est.spec.derived is not None
    key = next(c for c in est.breakdown if str(c) == "parameters")
    assert est.breakdown[key] < quant.base_parameter_bytes(est.spec, plan.with_(zero=0))


def test_mixed_policy_gathers_the_cast_floats_and_the_uint8_codes():
    """Under MixedPrecisionPolicy(param_dtype=bf16) a decoder layer's gathered base is its packed codes (uint8, as
    stored) plus every other parameter of the layer cast to bf16: under fp32 those are 4 bytes each. The difference,
    2 bytes per element of the layer's non-Linear parameters, counted on transformers' model on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmem.components import quant
    from llmem.runtime.model import hf_config

    cfg = row_config("gpt_neox-wide")  # LayerNorms with biases, biased Linears
    plan = TrainingPlan(**{**_BASE, "zero": 3, "device": "cpu"})
    spec = ModelSpec.from_config(cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(cfg, plan))
    layer = model.gpt_neox.layers[0]
    linear_weights = {f"{n}.weight" for n, m in layer.named_modules() if type(m) is torch.nn.Linear}
    floats = sum(p.numel() for n, p in layer.named_parameters() if n not in linear_weights)
    fp32 = quant.fsdp_layer_base_bytes(spec, plan, 0, gathered=True)
    mixed = quant.fsdp_layer_base_bytes(spec, plan.with_(precision="bf16-mixed"), 0, gathered=True)
    assert fp32 - mixed == 2 * floats  # (dp x the padded shard: the layer's numels divide by 2 here)
