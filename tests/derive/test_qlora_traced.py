"""QLoRA on the traced architectures (`llmem.derive.quant`): the 4-bit base the trace quantizes as the measured step
does, its dequantized weights inside the traced windows. The storage of the quantized base against the real
bitsandbytes model's tensors; the estimate against a real CPU run within 1 % (one plan by default, a grid of
families x nf4/fp4 x double quantization x checkpointing x one rank / DDP with `-m heavy`); what is not traced
yet refused naming the field."""

from __future__ import annotations

import pytest

from llmem.components import quant
from llmem.components.lora_activations import traced_spec
from llmem.errors import InputError
from llmem.estimate import estimate
from llmem.measure.run import measure_rank
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from tests.components.multirank import TwoRankRows
from tests.derive.test_lora_derived import config_of

TOLERANCE = 0.01
# wide MLPs and a small vocabulary: the layers' moments (a dequantized weight among them) are the peak
WIDE = {
    "gpt_neox": dict(model_type="gpt_neox", hidden_size=128, intermediate_size=1024, num_hidden_layers=2,
                     num_attention_heads=4, vocab_size=64, max_position_embeddings=256, rotary_pct=0.25),
    "falcon": dict(model_type="falcon", hidden_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=64,
                   new_decoder_architecture=False, multi_query=True, parallel_attn=True, bias=False),
    "phi": dict(model_type="phi", hidden_size=128, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=64),
    "opt": dict(model_type="opt", hidden_size=128, ffn_dim=1024, num_hidden_layers=2, num_attention_heads=4,
                vocab_size=64, max_position_embeddings=256, word_embed_proj_dim=128),
    "gpt2": dict(model_type="gpt2", n_embd=128, n_inner=1024, n_layer=2, n_head=4, vocab_size=64, n_positions=256,
                 bos_token_id=0, eos_token_id=0),  # Conv1D: quantized transposed, as transformers' loader does
    "starcoder2": dict(model_type="starcoder2", hidden_size=128, intermediate_size=1024, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=64, bos_token_id=None,
                       eos_token_id=None),
}
_BASE = dict(method="qlora", quant="nf4", lora_targets="all-linear", batch_size=2, seq_len=64)


def grid_case(family: str, plan: dict) -> tuple[dict, dict]:
    """A grid case's config (the family's wide variant where the plan says `wide`) and the plan without that key."""
    plan = dict(plan)
    return (WIDE[family] if plan.pop("wide", False) else config_of(family)), plan


def row_config(name: str) -> dict:
    """A two-rank row's config: the family before the first '-', its wide variant when the name says '-wide'."""
    family = name.split("-")[0]
    return WIDE[family] if "-wide" in name else config_of(family)


def _error(cfg: dict, base: dict = _BASE, **plan) -> float:
    """(estimate - measured) / measured of the traced QLoRA plan `base` + `plan` (fp32 unless it says)."""
    p = TrainingPlan(**{"device": "cpu", **base, "precision": "fp32", **plan})
    est = estimate(ModelSpec.from_config(cfg), p)
    assert est.spec.derived is not None  # the traced tables answered
    measured = measure_rank(cfg, p)["peak_bytes"]
    print(f"{cfg['model_type']} {plan}: estimate {est.peak_bytes:,} measured {measured:,} "
          f"({(est.peak_bytes - measured) / measured:+.3%}, {est.peak_phase})")
    return (est.peak_bytes - measured) / measured


@pytest.mark.parametrize("family", ["gpt_neox", "falcon", "gpt2"])
def test_quantized_base_bytes_equal_the_bitsandbytes_model(family):
    """Every parameter of the quantized model and each 4-bit weight's quant_state (absmax, code table; double
    quantization's nested state), counted from the real tensors bitsandbytes makes, against the inventory's
    storage. falcon's FalconLinear projections are not converted by transformers (`type(m) is nn.Linear`)."""
    import torch
    from bitsandbytes.nn import Params4bit
    from transformers import AutoModelForCausalLM

    from llmem.runtime.lora import quantize_base
    from llmem.runtime.model import hf_config

    cfg = config_of(family)
    plan = TrainingPlan(method="qlora", quant="nf4", double_quant=True, precision="bf16")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(cfg, plan), dtype=torch.bfloat16)
    quantize_base(model, plan)
    seen, total = set(), 0

    def add(t):
        nonlocal total
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    for p in model.parameters():
        add(p)
        state = p.quant_state if isinstance(p, Params4bit) else None
        while state is not None:
            for t in (state.absmax, state.code, state.offset):
                if isinstance(t, torch.Tensor):
                    add(t)
            state = state.state2
    from bitsandbytes import functional  # the process's own map, made by the first double quantization and kept

    add(functional.name2qmap["dynamic"])
    spec = traced_spec(ModelSpec.from_config(cfg), plan)  # falcon: hand-written inventory, traced LoRA
    assert quant.base_parameter_bytes(spec, plan) == total


def test_traced_qlora_within_one_percent():
    """falcon (its Linears left unquantized by transformers) in fp32: storage and the traced LoRA program."""
    assert abs(_error(config_of("falcon"))) <= TOLERANCE


GRID = {
    "gpt_neox-ckpt-bf16": ("gpt_neox", dict(grad_ckpt="full", precision="bf16")),
    "gpt_neox-qkv-dq": ("gpt_neox", dict(double_quant=True, lora_targets="query_key_value")),
    "phi-fp4-dq-bf16-dropout": ("phi", dict(quant="fp4", double_quant=True, precision="bf16", lora_dropout=0.1)),
    "starcoder2-ckpt-bf16": ("starcoder2", dict(grad_ckpt="full", precision="bf16")),
    "stablelm-ckpt-bf16": ("stablelm", dict(grad_ckpt="full", precision="bf16")),
    "gpt2-ckpt-bf16": ("gpt2", dict(grad_ckpt="full", precision="bf16")),
    "opt-ckpt": ("opt", dict(grad_ckpt="full")),  # layer 0's input needs a gradient: transformers' hook
    "opt-ckpt-bf16": ("opt", dict(grad_ckpt="full", precision="bf16")),
    **{f"wide-{f}": (f, dict(wide=True)) for f in WIDE},
    **{f"wide-{f}-dq-bf16": (f, dict(wide=True, double_quant=True, precision="bf16", lora_dropout=0.0)) for f in WIDE},
    "wide-gpt_neox-qkv-ckpt": ("gpt_neox", dict(wide=True, grad_ckpt="full", lora_targets="query_key_value")),
}


@pytest.mark.heavy
@pytest.mark.parametrize("name", sorted(GRID))
def test_traced_qlora_grid(name):
    cfg, plan = grid_case(*GRID[name])
    assert abs(_error(cfg, **plan)) <= TOLERANCE


TWO = TwoRankRows(dict(_BASE, gpus=2, zero=0, precision="fp32"), {
    "falcon-ckpt": dict(grad_ckpt="full"),
    "gpt_neox": dict(),
    "phi-wide": dict(),
    "starcoder2-wide-ckpt": dict(grad_ckpt="full"),
}, row_config, sampled=())


@pytest.mark.heavy
@pytest.mark.parametrize("name", list(TWO.rows))
def test_traced_qlora_ddp(name):
    TWO.check(name, TOLERANCE)


@pytest.mark.parametrize("family, plan, field", [
    ("olmo2", dict(quant="int8", precision="bf16", gpus=2, zero=3), "quant"),  # FSDP2 drops Int8Params' CB/SCB
    ("gpt_neox", dict(quant="int8", precision="bf16-mixed"), "precision"),  # 8-bit base under autocast: a gap
])
def test_what_is_not_traced_is_refused_naming_the_field(family, plan, field):
    """(ZeRO-1 and FSDP2 over a traced 4-bit base, and ZeRO-1 over an 8-bit one: test_qlora_traced_sharded.py.)"""
    with pytest.raises(InputError) as err:
        p = TrainingPlan(**{"method": "qlora", "precision": "fp32", "seq_len": 64, **plan})
        estimate(ModelSpec.from_config(config_of(family)), p)
    text = str(err.value)
    assert text.startswith(f"{field}: ") and "\n" not in text, text
