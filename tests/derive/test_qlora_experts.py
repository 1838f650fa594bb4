"""QLoRA on a traced mixture of experts (docs/MODEL-QLORA-MOE.md): transformers' bitsandbytes replacement converts the
`nn.Linear`s only, so the fused 3-D experts and the router stay in the load dtype. The model the measured step builds
against the one transformers' loader makes with a `BitsAndBytesConfig`; the estimate against a real CPU run within
1 % (`-m heavy`: one rank and DDP, nf4 ± double quantization, int8, fp32 / bf16 / bf16-mixed, checkpointed or not)."""

from __future__ import annotations

import pytest

from llmem.estimate import estimate
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from tests.components.multirank import TwoRankRows
from tests.derive.configs import assert_estimate_near_measure, config

TOLERANCE = 0.01
_BASE = dict(method="qlora", quant="nf4", batch_size=2, seq_len=64, precision="fp32", lora_dropout=0.0)
# wide experts and a small vocabulary: the decoder layers' moments (a dequantized weight, the experts' grouped mm)
# are the peak, not the loss
WIDE = dict(hidden_size=128, moe_intermediate_size=512, vocab_size=64, max_position_embeddings=256)


def _config(name: str) -> dict:
    family = name.split("-")[0]
    if "-4l" in name:  # four layers: --ckpt-every 2 leaves layers 1 and 3 uncheckpointed
        return config(family, num_hidden_layers=4)
    return config(family, **WIDE) if "-wide" in name else config(family)


@pytest.mark.parametrize("family", ["gpt_oss", pytest.param("qwen3_moe", marks=pytest.mark.heavy)])
def test_the_measured_base_is_the_one_transformers_loads(family):
    """gpt_oss (`GptOssTopKRouter`, a module holding an nn.Parameter weight and bias; experts with biases) and
    qwen3_moe (`Qwen3MoeTopKRouter`): every parameter's class, dtype and shape as `from_pretrained(...,
    quantization_config=BitsAndBytesConfig(load_in_4bit=True))` leaves them (the experts and router unquantized, in
    the load dtype), and the inventory's storage of the quantized base equals the real tensors' bytes."""
    import tempfile

    import torch
    from bitsandbytes.nn import Params4bit
    from transformers import AutoModelForCausalLM

    from llmem.components import quant
    from llmem.runtime.lora import bnb_config, quantize_base
    from llmem.runtime.model import hf_config

    plan = TrainingPlan(method="qlora", quant="nf4", precision="bf16")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(config(family), plan), dtype=torch.bfloat16)
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16, device_map="cpu",
                                                      quantization_config=bnb_config(plan))
    quantize_base(model, plan)

    def described(m):
        return {n: (type(p).__name__, p.dtype, tuple(p.shape)) for n, p in m.named_parameters()}
    assert described(model) == described(loaded)
    experts = {n: d for n, d in described(model).items() if ".experts." in n or ".router." in n or ".gate." in n}
    assert experts and {d[:2] for d in experts.values()} == {("Parameter", torch.bfloat16)}
    total = sum(p.untyped_storage().nbytes() for p in model.parameters())
    total += sum(p.quant_state.absmax.untyped_storage().nbytes() + p.quant_state.code.untyped_storage().nbytes()
                 for p in model.parameters() if isinstance(p, Params4bit))
    assert quant.base_parameter_bytes(ModelSpec.from_config(config(family)), plan) == total


# measured (2 × 64): see docs/MODEL-QLORA-MOE.md
ONE_RANK = {
    "qwen3_moe-all": dict(lora_targets="all-linear"),
    "qwen3_moe-all-dq-bf16": dict(lora_targets="all-linear", double_quant=True, precision="bf16"),
    "qwen3_moe-qv-bf16-ckpt": dict(lora_targets="q_proj,v_proj", precision="bf16", grad_ckpt="full"),
    "qwen3_moe-all-ckpt": dict(lora_targets="all-linear", grad_ckpt="full"),
    "qwen3_moe-int8-qv": dict(quant="int8", lora_targets="q_proj,v_proj"),
    "qwen3_moe-int8-all-bf16-ckpt": dict(quant="int8", lora_targets="all-linear", precision="bf16", grad_ckpt="full"),
    "qwen3_moe-fp4-all-bf16": dict(quant="fp4", lora_targets="all-linear", precision="bf16"),
    "glm4_moe-all": dict(lora_targets="all-linear"),
    "glm4_moe-qv-dq-bf16-ckpt": dict(lora_targets="q_proj,v_proj", double_quant=True, precision="bf16",
                                     grad_ckpt="full"),
    "glm4_moe-int8-all": dict(quant="int8", lora_targets="all-linear"),
    "glm4_moe-mlp-bf16": dict(lora_targets="q_proj,gate_proj,up_proj,down_proj", precision="bf16"),
    "olmoe-all-bf16-ckpt": dict(lora_targets="all-linear", precision="bf16", grad_ckpt="full"),
    "qwen3_moe-wide-all": dict(lora_targets="all-linear"),
    "qwen3_moe-wide-qv-dq-bf16-ckpt": dict(lora_targets="q_proj,v_proj", double_quant=True, precision="bf16",
                                           grad_ckpt="full"),
    "qwen3_moe-wide-int8-all-bf16": dict(quant="int8", lora_targets="all-linear", precision="bf16"),
    "olmoe-wide-all-ckpt": dict(lora_targets="all-linear", grad_ckpt="full"),
    "qwen3_moe-all-bf16mix": dict(lora_targets="all-linear", precision="bf16-mixed"),
    "qwen3_moe-qv-bf16mix-ckpt": dict(lora_targets="q_proj,v_proj", precision="bf16-mixed", grad_ckpt="full"),
    "glm4_moe-all-bf16mix": dict(lora_targets="all-linear", precision="bf16-mixed"),
    "qwen3_moe-wide-all-bf16mix": dict(lora_targets="all-linear", precision="bf16-mixed"),
    # the other traced families: attention Linears (MLA's for deepseek), routers unquantized (gpt_oss, granitemoe:
    # router modules, not Linears)
    **{f"{f}-qv": dict(lora_targets="q_proj,v_proj") for f in ("flex_olmo", "granitemoe", "granitemoeshared",
                                                                  "minimax_m2")},
    "deepseek_v2-q-kvb": dict(lora_targets="q_proj,kv_b_proj"),
    "deepseek_v3-mla-bf16": dict(lora_targets="q_a_proj,kv_b_proj,o_proj", precision="bf16"),
    "deepseek_v3-all-dq-bf16-ckpt": dict(lora_targets="all-linear", double_quant=True, precision="bf16",
                                         grad_ckpt="full"),
    "gpt_oss-qv-eager": dict(lora_targets="q_proj,v_proj", attn="eager"),
    "gpt_oss-int8-qv-bf16-eager": dict(quant="int8", lora_targets="q_proj,v_proj", precision="bf16", attn="eager"),
    "granitemoe-int8-qv-bf16-ckpt": dict(quant="int8", lora_targets="q_proj,v_proj", precision="bf16",
                                         grad_ckpt="full"),
    "qwen3_moe-4l-all-ckpt2": dict(lora_targets="all-linear", grad_ckpt="full", ckpt_every=2),
    "glm4_moe-4l-int8-qv-bf16-ckpt2": dict(quant="int8", lora_targets="q_proj,v_proj", precision="bf16",
                                           grad_ckpt="full", ckpt_every=2),
    "gpt_oss-qv-bf16mix-eager": dict(lora_targets="q_proj,v_proj", precision="bf16-mixed", attn="eager"),
    "granitemoe-qv-bf16mix-ckpt": dict(lora_targets="q_proj,v_proj", precision="bf16-mixed", grad_ckpt="full"),
}


@pytest.mark.heavy
@pytest.mark.parametrize("name", list(ONE_RANK))
def test_traced_qlora_on_experts_within_one_percent(name):
    p = TrainingPlan(device="cpu", **{**_BASE, **ONE_RANK[name]})
    est = assert_estimate_near_measure(_config(name), p, TOLERANCE, name)
    assert est.spec.derived is not None


TWO = TwoRankRows({**_BASE, "gpus": 2}, {
    "qwen3_moe-all-ddp": dict(lora_targets="all-linear"),
    "qwen3_moe-qv-ddp-bf16-ckpt": dict(lora_targets="q_proj,v_proj", precision="bf16", grad_ckpt="full"),
    "glm4_moe-all-ddp-dq-bf16": dict(lora_targets="all-linear", double_quant=True, precision="bf16"),
    "qwen3_moe-wide-int8-all-ddp": dict(quant="int8", lora_targets="all-linear"),
}, _config, sampled=())


@pytest.mark.heavy
@pytest.mark.parametrize("name", list(TWO.rows))
def test_traced_qlora_on_experts_ddp_within_one_percent(name):
    TWO.check(name, TOLERANCE)


@pytest.mark.parametrize("family, plan, field", [
    ("gpt_oss", dict(lora_targets="all-linear"), "lora-targets"),  # no PEFT rewrite onto its fused experts
    ("qwen3_moe", dict(lora_targets="all-linear", lora_dropout=0.1), "lora-dropout"),  # PEFT's ParamWrapper refuses
])
def test_what_is_not_modelled_is_refused_naming_the_field(family, plan, field):
    from llmem.errors import InputError

    with pytest.raises(InputError) as err:
        estimate(ModelSpec.from_config(config(family)), TrainingPlan(**{**_BASE, **plan}))
    text = str(err.value)
    assert text.startswith(f"{field}: ") and "\n" not in text, text
