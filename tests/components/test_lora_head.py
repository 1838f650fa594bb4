"""LoRA on the output layer (`--lora-targets ...,lm_head`, `llmem.components.lora_head`): the adapter counts against
PEFT on the meta device, the refusals naming the field, and the estimate against real CPU runs (allocator trace).

Tolerance: the fp32 rows here measured within 0.01 % (the same few hundred bytes under as without the head's
adapter), the bf16-mixed ones +0.06 % and +0.09 % (the plans' over-estimate without it); the asserted 0.2 % bound
catches any of the modelled tensors going missing: the smallest, lora_B's saved T × r input, is 0.3 % of the
activation-dominated fp32 peak, the final hidden states lora_A keeps 1.1 %."""

from __future__ import annotations

import pytest

from llmem.components import lora
from llmem.errors import InputError
from llmem.estimate import estimate
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from tests.components.test_activations import CONFIGS
from tests.components.test_lora_modules_to_save import LARGE, TIED

TOL = 0.002
_QV = "q_proj,v_proj,lm_head"


@pytest.mark.parametrize("config,targets", [
    (CONFIGS["llama"], _QV), (TIED, _QV), (CONFIGS["qwen3"], "gate_proj,up_proj,down_proj,lm_head")])
def test_trainable_params_equal_peft_on_meta(config, targets):
    from tests.components.test_lora import peft_model_on_meta

    plan = TrainingPlan(method="lora", precision="fp32", lora_rank=8, lora_targets=targets)
    trainable, total = peft_model_on_meta(config, plan).get_nb_trainable_parameters()
    spec = ModelSpec.from_config(config)
    assert lora.trainable_params(spec, plan) == trainable and lora.total_params(spec, plan) == total


@pytest.mark.parametrize("config,plan,field", [
    (CONFIGS["llama"], dict(lora_targets="lm_head"), "lora-targets"),  # no decoder-layer adapter
    (CONFIGS["llama"], dict(method="qlora", quant="nf4"), "lora-targets"),
    (CONFIGS["llama"], dict(precision="bf16"), "lora-targets"),
    (CONFIGS["llama"], dict(gpus=2, zero=3), "lora-targets"),
    (CONFIGS["gemma2"], {}, "lora-targets"),  # a traced LoRA family
    (CONFIGS["llama"], dict(lora_targets="q_proj,v_proj,embed_out"), "lora-targets"),  # no such module: PEFT skips
])
def test_unmodelled_plans_name_the_field(config, plan, field):
    with pytest.raises(InputError) as err:
        plan = TrainingPlan(**{"method": "lora", "precision": "fp32", "lora_targets": _QV, **plan})
        estimate(ModelSpec.from_config(config), plan)
    assert err.value.field == field and "output layer" in str(err.value)


def _error(config: dict, **plan) -> float:
    from llmem.measure.run import measure_rank

    p = TrainingPlan(**{"device": "cpu", "optimizer_impl": "forloop", "batch_size": 4, "seq_len": 64,
                        "method": "lora", "precision": "fp32", "lora_targets": _QV, "lora_dropout": 0.0, **plan})
    measured = measure_rank(config, p)["peak_bytes"]
    return (estimate(ModelSpec.from_config(config), p).peak_bytes - measured) / measured


def test_activation_dominated_peak():
    """Loss-backward peak: the final hidden states lora_A keeps, lora_B's T × r input, the adapters and states."""
    pytest.importorskip("torch")
    assert abs(_error(CONFIGS["llama"])) < TOL


@pytest.mark.heavy
@pytest.mark.parametrize("config,plan", [
    (CONFIGS["llama"], dict(lora_dropout=0.1)),  # dropout's output and noise instead of x
    (TIED, dict(batch_size=1, seq_len=32)),  # tied: the head's Linear adapted, the shared weight frozen
    (LARGE, dict(batch_size=1, seq_len=32)),  # parameter-dominated: the (V, r) lora_B last in the for-loop step
    (CONFIGS["qwen3"], dict(lora_targets="o_proj,lm_head", optimizer="sgd")),
    (CONFIGS["llama"], dict(precision="bf16-mixed")),  # autocast: lora_A's half input copy, half weight casts
    (TIED, dict(precision="bf16-mixed", lora_dropout=0.1, batch_size=1, seq_len=32)),
])
def test_more_programs(config, plan):
    pytest.importorskip("torch")
    assert abs(_error(config, **plan)) < TOL


def _two_rank_runs():
    from tests.components.multirank import TwoRankRows

    base = dict(gpus=2, zero=0, optimizer_impl="forloop", batch_size=2, seq_len=64, method="lora", lora_targets=_QV)
    rows = {"ddp-fp32": dict(precision="fp32"), "ddp-tied-bf16mix": dict(precision="bf16-mixed", lora_dropout=0.0)}
    return TwoRankRows(base, rows, lambda name: dict(TIED if "tied" in name else CONFIGS["llama"]), sampled=())


TWO_RANKS = _two_rank_runs()


@pytest.mark.heavy
@pytest.mark.parametrize("name", ["ddp-fp32", "ddp-tied-bf16mix"])
def test_two_ranks_ddp(name):
    """DDP buckets the head adapter's gradients with the others' (the lm_head's are the first made)."""
    pytest.importorskip("torch")
    TWO_RANKS.check(name, tolerance=0.01)


def test_head_module_is_the_real_models_output_layer():
    """`head_module` against transformers 5.23 on the meta device, every family tied and untied (test_spec's
    cases): the name of the module `get_output_embeddings()` returns (GPT-NeoX's is `lm_head`, not transformers 4's
    `embed_out`)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmem.components.lora_head import head_module
    from tests.test_spec import CASES, TINY

    for model_type, extra in CASES:
        config = {**TINY, **extra, "model_type": model_type}
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
        head = model.get_output_embeddings()
        real = next(n for n, m in model.named_modules() if m is head)
        assert head_module(ModelSpec.from_config(config)) == real, (model_type, extra)


@pytest.mark.parametrize("tied", [False, True])
def test_gpt_neox_head_adapter_against_peft(tied):
    """gpt_neox: PEFT adapts `lm_head` (every adapter's name and shape here is PEFT's), and ignores
    `embed_out` without a word when another target matches, so an estimate with it is refused, naming lm_head."""
    pytest.importorskip("torch")
    from tests.components.test_lora import peft_model_on_meta
    from tests.test_spec import TINY

    config = {**TINY, "model_type": "gpt_neox", "tie_word_embeddings": tied}
    spec = ModelSpec.from_config(config)
    head = TrainingPlan(method="lora", precision="fp32", lora_rank=8, lora_targets="query_key_value,lm_head")
    real = {n.removeprefix("base_model.model."): tuple(p.shape)
            for n, p in peft_model_on_meta(config, head).named_parameters() if ".lora_" in n}
    assert {p.name: p.shape for p in lora.adapter_params(spec, head)} == real
    stale = TrainingPlan(method="lora", precision="fp32", lora_rank=8, lora_targets="query_key_value,embed_out")
    names = [n for n, _ in peft_model_on_meta(config, stale).named_parameters() if ".lora_" in n]
    assert names and not [n for n in names if "layers." not in n]  # the run has no head adapter
    with pytest.raises(InputError) as err:
        estimate(spec, stale)
    assert err.value.field == "lora-targets" and "lm_head" in str(err.value)
