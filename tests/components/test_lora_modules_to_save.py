"""`--lora-modules-to-save` (PEFT's modules_to_save): trainable counts against PEFT on the meta device, validation
naming the field, and the estimate against real CPU runs (allocator trace; two gloo ranks for DDP / ZeRO-1).

Tolerance: the contract is 2 % single-rank and 3 % multi-rank; every row here measured within 0.02 %, so the
asserted 0.5 % bound is tight enough to catch any of the modelled tensors going missing (the smallest, the lm_head
input kept for its weight gradient, is about 1 % of these peaks) while leaving room for allocator noise."""

from __future__ import annotations

import pytest

from llmem.components import lora
from llmem.errors import InputError
from llmem.estimate import estimate
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from tests.components.test_activations import CONFIGS

TOL = 0.005
# parameter-dominated (vocab 4000 × 256, few tokens): the optimizer step and the lm_head backward set the peak
LARGE = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 4000, "max_position_embeddings": 256,
         "tie_word_embeddings": False}
TIED = {**LARGE, "tie_word_embeddings": True}


@pytest.mark.parametrize("family,to_save,targets", [
    ("llama", "lm_head", "all-linear"), ("llama", "embed_tokens", "q_proj,v_proj"),
    ("llama", "lm_head,embed_tokens", "all-linear"), ("qwen3", "embed_tokens,lm_head", "q_proj,k_proj,v_proj"),
    # a tied model: PEFT copies each module apart and the tie breaks, the frozen original stays one shared tensor
    ("tied", "lm_head", "q_proj,v_proj"), ("tied", "lm_head,embed_tokens", "all-linear"),
    ("gpt2", "lm_head", "c_attn"), ("gpt2", "wte", "c_attn"),
])
def test_trainable_params_equal_peft_on_meta(family, to_save, targets):
    from tests.components.test_lora import peft_model_on_meta

    cfg = TIED if family == "tied" else CONFIGS[family]
    plan = TrainingPlan(method="lora", lora_rank=8, lora_targets=targets, lora_modules_to_save=to_save)
    model = peft_model_on_meta(cfg, plan)
    trainable, total = model.get_nb_trainable_parameters()
    spec = ModelSpec.from_config(cfg)
    assert lora.trainable_params(spec, plan) == trainable
    assert lora.total_params(spec, plan) == total
    copies = {n for n, p in model.named_parameters() if p.requires_grad and "modules_to_save" in n}
    assert {f"base_model.model.{c.name}" for c in lora.module_copies(spec, plan)} == copies


def test_parsing_and_plan_validation_name_the_field():
    assert TrainingPlan(method="lora", lora_modules_to_save=" lm_head , embed_tokens,lm_head").lora_modules_to_save \
        == "lm_head,embed_tokens"
    assert TrainingPlan(method="lora", lora_modules_to_save=["lm_head"]).lora_modules_to_save == "lm_head"
    for bad in (dict(method="lora", lora_modules_to_save="lm_head;rm"),
                dict(method="full", lora_modules_to_save="lm_head"),  # copies are a LoRA option
                dict(method="lora", gpus=2, zero=3, offload="optimizer+params", lora_modules_to_save="lm_head"),
                dict(method="lora", gpus=2, zero=1, precision="bf16", lora_modules_to_save="lm_head")):  # ZeRO-1 dtypes
        with pytest.raises(InputError) as err:
            TrainingPlan(**bad)
        assert err.value.field == "lora-modules-to-save"
    TrainingPlan(method="lora", gpus=2, zero=1, precision="bf16-mixed", lora_modules_to_save="lm_head")


@pytest.mark.parametrize("config,name,says", [
    (CONFIGS["llama"], "lm_headx", "matches no module"),
    (CONFIGS["llama"], "norm", "not modelled"),  # PEFT would copy every *norm module: not modelled
    (CONFIGS["llama"], "q_proj", "not modelled"),
])
def test_model_validation_names_the_field_and_the_valid_names(config, name, says):
    with pytest.raises(InputError) as err:
        estimate(ModelSpec.from_config(config), TrainingPlan(method="lora", lora_modules_to_save=name))
    assert err.value.field == "lora-modules-to-save" and says in str(err.value)
    assert "embed_tokens, lm_head" in str(err.value)


def _error(config: dict, **plan) -> float:
    from llmem.measure.run import measure_rank

    p = TrainingPlan(**{"device": "cpu", "optimizer_impl": "forloop", "batch_size": 4, "seq_len": 64,
                        "method": "lora", "lora_dropout": 0.0, **plan})
    measured = measure_rank(config, p)["peak_bytes"]
    return (estimate(ModelSpec.from_config(config), p).peak_bytes - measured) / measured


@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-mixed"])
@pytest.mark.parametrize("to_save", ["lm_head", "embed_tokens", "lm_head,embed_tokens"])
def test_activation_dominated_peak(to_save, precision):
    """Loss-backward peaks: the lm_head copy's saved input, layer 0 saving as the others with a trainable
    embedding, the copies' parameters and states."""
    pytest.importorskip("torch")
    assert abs(_error(CONFIGS["llama"], precision=precision, lora_modules_to_save=to_save)) < TOL


@pytest.mark.parametrize("plan", [
    dict(precision="fp32", lora_modules_to_save="lm_head"),  # AdamW for-loop: the previous adapter's denom bound
    dict(precision="bf16", lora_modules_to_save="lm_head,embed_tokens"),
    dict(precision="bf16-mixed", lora_modules_to_save="embed_tokens", grad_accum=2),
    dict(precision="fp32", lora_modules_to_save="lm_head,embed_tokens", optimizer="adafactor",
         optimizer_impl="default"),
    dict(precision="bf16", lora_modules_to_save="lm_head,embed_tokens", optimizer="adamw8bit",
         optimizer_impl="default"),
])
def test_parameter_dominated_peak(plan):
    """Optimizer-step peaks with copies of the plan's dtype beside fp32 adapters (per-tensor dtypes)."""
    pytest.importorskip("torch")
    assert abs(_error(LARGE, batch_size=1, seq_len=32, **plan)) < TOL


@pytest.mark.parametrize("plan", [
    dict(precision="fp32", lora_modules_to_save="lm_head,embed_tokens", grad_accum=2),
    dict(precision="bf16", lora_modules_to_save="embed_tokens", optimizer="sgd"),
    dict(precision="bf16", method="qlora", quant="nf4", lora_modules_to_save="lm_head"),
    dict(precision="bf16-mixed", lora_modules_to_save="", lora_targets="q_proj,v_proj"),
])
def test_more_programs(plan):
    """Accumulation, SGD, a 4-bit base; and plain LoRA under autocast, where layer 0's q/k/v weight casts are not
    saved (its input needs no gradient): +1.1 % before that was modelled."""
    pytest.importorskip("torch")
    assert abs(_error(CONFIGS["llama"], **plan)) < TOL


@pytest.mark.parametrize("plan", [
    dict(precision="bf16", lora_modules_to_save="lm_head,embed_tokens"),
    pytest.param(dict(precision="fp32", lora_modules_to_save="lm_head"), marks=pytest.mark.heavy),
    pytest.param(dict(precision="bf16-mixed", lora_modules_to_save="embed_tokens", grad_accum=2),
                 marks=pytest.mark.heavy),
])
def test_a_tied_model_whose_tie_the_copies_break(plan):
    """The parameter-dominated model tied: one shared frozen weight beside the copies (the untied model's peak less
    one frozen vocab x hidden weight, measured)."""
    pytest.importorskip("torch")
    assert abs(_error(TIED, batch_size=1, seq_len=32, **plan)) < TOL


MULTI = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 256,
         "tie_word_embeddings": False}
MULTI_BASE = {"batch_size": 2, "seq_len": 64, "precision": "fp32", "optimizer": "adamw", "optimizer_impl": "forloop",
              "method": "lora", "lora_dropout": 0.0, "gpus": 2}
MULTI_ROWS = {
    "ddp-head-fp32": {"zero": 0, "lora_modules_to_save": "lm_head"},
    "ddp-both-bf16mix": {"zero": 0, "lora_modules_to_save": "lm_head,embed_tokens", "precision": "bf16-mixed"},
    "ddp-embed-bf16": {"zero": 0, "lora_modules_to_save": "embed_tokens", "precision": "bf16"},
    "zero1-both-fp32": {"zero": 1, "lora_modules_to_save": "lm_head,embed_tokens"},
    "ddp-both-accum2": {"zero": 0, "lora_modules_to_save": "lm_head,embed_tokens", "grad_accum": 2},
}
_MULTI: dict = {}


@pytest.mark.heavy  # the suite's cover measures modules_to_save under DDP by default (d2-llama-lora-mts-both-ddp)
@pytest.mark.parametrize("name", list(MULTI_ROWS))
def test_two_ranks(name):
    """DDP buckets the copies' gradients with the adapters'; ZeRO-1 partitions copies and adapters by size."""
    pytest.importorskip("torch")
    if not _MULTI:
        from llmem.measure.launch import run_job

        rows = [{"id": k, "config": MULTI, "plan": {**MULTI_BASE, **v}, "steps": 2} for k, v in MULTI_ROWS.items()]
        results, err = run_job(rows, 2, "cpu", timeout=900)
        _MULTI.update({r["id"]: r for r in results})
        if not _MULTI:
            pytest.fail(f"the 2-process launch measured nothing: {err}")
    res = _MULTI[name]
    assert "error" not in res, res.get("error")
    plan = TrainingPlan(**{**MULTI_BASE, **MULTI_ROWS[name], "device": "cpu"})
    est = estimate(ModelSpec.from_config(MULTI), plan).peak_bytes
    assert abs(est - res["peak_bytes"]) <= TOL * res["peak_bytes"], (est, res)
