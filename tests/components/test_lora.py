"""LoRA (PEFT) and gradient accumulation: closed-form trainable counts against PEFT on the meta device, and the
single-rank estimate against a real CPU run (allocator trace) within 2 %."""

from __future__ import annotations

import pytest

from llmem.components import lora
from llmem.errors import InputError
from llmem.estimate import estimate
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from tests.components.test_activations import CONFIGS

COUNT_CASES = [
    ("llama", "all-linear", 16), ("llama", "q_proj,v_proj", 8), ("qwen3", "all-linear", 4),
    ("gemma", "self_attn.o_proj,down_proj", 16), ("phi3", "all-linear", 8),
    ("gpt2", "all-linear", 8), ("gpt2", "c_attn", 4), ("opt", "all-linear", 8),
    ("gpt_neox", "query_key_value,dense_4h_to_h", 16), ("falcon", "all-linear", 2),
]


def peft_model_on_meta(cfg: dict, plan: TrainingPlan):
    """The PEFT model the runtime builds for `plan`, on the meta device (PEFT's own parameter counts, no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmem.runtime.lora import apply_method
    from llmem.runtime.model import hf_config

    with torch.device("meta"):
        return apply_method(AutoModelForCausalLM.from_config(hf_config(cfg, plan)), plan)


@pytest.mark.parametrize("family,targets,rank", COUNT_CASES)
def test_trainable_params_equal_peft_on_meta(family, targets, rank):
    cfg = CONFIGS[family]
    plan = TrainingPlan(method="lora", lora_rank=rank, lora_targets=targets)
    model = peft_model_on_meta(cfg, plan)
    trainable, total = model.get_nb_trainable_parameters()
    spec = ModelSpec.from_config(cfg)
    assert lora.trainable_params(spec, plan) == trainable
    assert lora.total_params(spec, plan) == total


def test_full_fine_tuning_trains_everything():
    spec = ModelSpec.from_config(CONFIGS["llama"])
    assert lora.trainable_params(spec, TrainingPlan()) == spec.total_params


def test_plan_validation_names_the_flag():
    with pytest.raises(InputError, match="quant"):
        TrainingPlan(method="qlora")  # qlora needs --quant nf4|fp4
    with pytest.raises(InputError, match="^lora-targets:"):
        TrainingPlan(method="lora", gpus=2, tp=2)  # all-linear adapts row-parallel Linears: PEFT's fail under TP
    with pytest.raises(InputError, match="^tp:"):
        TrainingPlan(method="lora", gpus=2, tp=2, lora_targets="q_proj", grad_ckpt="full")  # not modelled yet
    with pytest.raises(InputError, match="lora-dropout"):
        TrainingPlan(method="lora", lora_dropout=1.5)
    with pytest.raises(InputError, match="lora-rank"):
        TrainingPlan(method="lora", lora_rank=0)
    with pytest.raises(InputError, match="grad-accum"):
        TrainingPlan(grad_accum=0)
    with pytest.raises(InputError, match="lora-targets"):
        TrainingPlan(method="lora", lora_targets="q_proj;v")
    with pytest.raises(InputError, match="lora-targets"):
        estimate(ModelSpec.from_config(CONFIGS["llama"]), TrainingPlan(method="lora", lora_targets="c_attn"))


def _error(family: str, layers: int | None = None, **plan) -> float:
    from llmem.measure.timeline import timeline

    cfg = CONFIGS[family] if layers is None else dict(CONFIGS[family], num_hidden_layers=layers)
    plan = {"precision": "fp32", **plan}
    p = TrainingPlan(device="cpu", optimizer_impl="forloop", batch_size=4, seq_len=64, **plan)
    measured = timeline(cfg, p).peak_bytes
    return (estimate(ModelSpec.from_config(cfg), p).peak_bytes - measured) / measured


@pytest.mark.parametrize("family,plan", [
    ("llama", dict(method="lora", lora_dropout=0.0)),
    ("llama", dict(method="lora", lora_dropout=0.1)),
    ("llama", dict(method="lora", lora_dropout=0.0, lora_targets="q_proj,v_proj", lora_rank=8)),
    ("qwen3", dict(method="lora", lora_dropout=0.0)),
    ("qwen3", dict(method="lora", lora_dropout=0.05)),
    ("llama", dict(grad_accum=2)),
    ("llama", dict(method="lora", lora_dropout=0.1, grad_accum=2)),
    ("llama", dict(method="lora", lora_dropout=0.0, precision="bf16-mixed")),
])
def test_peak_within_2_percent(family, plan):
    pytest.importorskip("torch")
    assert abs(_error(family, **plan)) < 0.02


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_qwen3_frozen_k_proj_first_layer(precision):
    """Adapters on q_proj and v_proj only: layer 0's k_proj (frozen, its input needs no gradient) makes a k that needs
    none either, so k_norm saves nothing there. Counting its fp32 input and rsqrt put this peak 1.6 % high while the
    LoRA rows with every projection adapted are within 0.05 %; 0.5 % separates the two."""
    pytest.importorskip("torch")
    err = _error("qwen3", method="lora", lora_dropout=0.0, lora_targets="q_proj,v_proj", lora_rank=8,
                 precision=precision)
    assert abs(err) < 0.005


# Target sets without an adapter on q_proj / k_proj / v_proj. Layer 0's input needs no gradient (frozen embeddings),
# so there each op saves only from the first adapted Linear on: with frozen q/k/v the whole attention and the first
# norm save nothing, the o_proj adapter keeps the (unsaved) sdpa output, and under autocast the frozen weights' copies
# before that Linear are not saved either. Before this was modelled the MLP-only set measured +12 % (bf16-mixed +4 to
# +6 %, from the copies); the rows with every projection adapted are within 0.05 %, so 0.5 % separates the two.
TARGET_CASES = [
    ("llama", "gate_proj,up_proj,down_proj", "fp32", 0.0),
    ("llama", "o_proj", "fp32", 0.1),
    ("llama", "down_proj", "bf16", 0.0),
    ("llama", "q_proj", "bf16-mixed", 0.0),
    ("llama", "k_proj,v_proj", "fp32", 0.0),
    ("llama", "gate_proj,up_proj,down_proj", "bf16-mixed", 0.1),
    ("qwen3", "o_proj", "bf16-mixed", 0.0),
    ("qwen3", "gate_proj,up_proj,down_proj", "bf16", 0.1),
    ("qwen3", "all-linear", "bf16-mixed", 0.0),
    ("gemma", "gate_proj,up_proj,down_proj", "bf16-mixed", 0.0),
    ("gemma", "down_proj", "fp32", 0.1),
    ("gemma", "o_proj", "bf16", 0.0),
]


@pytest.mark.parametrize("family,targets,precision,dropout", TARGET_CASES)
def test_target_sets_first_layer(family, targets, precision, dropout):
    pytest.importorskip("torch")
    err = _error(family, method="lora", lora_targets=targets, precision=precision, lora_dropout=dropout)
    assert abs(err) < 0.005


@pytest.mark.parametrize("family,targets,precision,dropout", [
    ("llama", "gate_proj,up_proj,down_proj", "fp32", 0.0),
    ("llama", "o_proj", "fp32", 0.1),
    ("qwen3", "q_proj", "fp32", 0.0),
    ("gemma", "down_proj", "bf16-mixed", 0.0),
])
def test_target_sets_with_checkpointing(family, targets, precision, dropout):
    """--grad-ckpt full: PEFT calls `enable_input_require_grads()` on a model with checkpointing enabled, so here
    layer 0 saves as every layer; with a frozen down_proj the MLP backward's third intermediate-sized gradient
    (d silu(gate) beside d up and the incoming one) is not offset by a saved down_proj input."""
    pytest.importorskip("torch")
    err = _error(family, method="lora", lora_targets=targets, precision=precision, lora_dropout=dropout,
                 grad_ckpt="full")
    assert abs(err) < 0.005


@pytest.mark.parametrize("family,targets,precision,every,tolerance", [
    ("llama", "all-linear", "fp32", 2, 0.005),
    ("qwen3", "o_proj", "fp32", 3, 0.005),
    ("gemma", "q_proj,v_proj", "bf16-mixed", 2, 0.005),
    # the last layer (4) is checkpointed and its backward is the peak: at the end of its recompute, locals of the
    # forward beyond those `lora.recompute_moments` names are alive (measured -1.0 %, see DESIGN.md)
    ("llama", "gate_proj,up_proj,down_proj", "bf16-mixed", 2, 0.02),
])
def test_ckpt_every(family, targets, precision, every, tolerance):
    """--ckpt-every K under LoRA: layers 0, K, 2K, ... keep their input, the others the LoRA table (5 layers, so
    both kinds and the partial last group occur)."""
    pytest.importorskip("torch")
    err = _error(family, layers=5, method="lora", lora_targets=targets, precision=precision, lora_dropout=0.05,
                 grad_ckpt="full", ckpt_every=every)
    assert abs(err) < tolerance


def test_targets_adapting_different_layers_are_refused_naming_the_field():
    spec = ModelSpec.from_config(CONFIGS["llama"])
    with pytest.raises(InputError) as err:
        estimate(spec, TrainingPlan(method="lora", lora_targets="layers.1.mlp.down_proj"))
    assert err.value.field == "lora-targets" and "all-linear" in str(err.value)
    estimate(spec, TrainingPlan(method="lora", lora_targets="mlp.down_proj"))  # every layer alike: modelled


def _suite_error(model: str, **plan) -> float:
    """Estimate vs a real CPU run of a CPU-suite model (tests/accuracy/suite.yaml), batch 2 × 64 tokens, with full
    checkpointing."""
    from pathlib import Path

    import yaml

    from llmem.measure.timeline import timeline

    config = yaml.safe_load((Path(__file__).parents[1] / "accuracy" / "suite.yaml").read_text())["models"][model]
    p = TrainingPlan(device="cpu", optimizer_impl="forloop", batch_size=2, seq_len=64, grad_ckpt="full", **plan)
    measured = timeline(config, p).peak_bytes
    return (estimate(ModelSpec.from_config(config), p).peak_bytes - measured) / measured


@pytest.mark.parametrize("model,plan", [
    ("llama-gqa", dict(method="lora", precision="bf16")),  # the recompute stops in down_proj's lora_B
    ("llama-gqa", dict(method="lora", precision="bf16", lora_dropout=0.0)),  # up_proj's adapter sum
    ("qwen2", dict(method="lora", precision="bf16")),
    ("mistral", dict(method="lora", precision="fp32", lora_dropout=0.05)),
    ("qwen3", dict(method="lora", precision="bf16", lora_dropout=0.0)),
    ("qwen3", dict(method="qlora", quant="nf4", precision="bf16", lora_dropout=0.1)),
    ("qwen3", dict(method="qlora", quant="nf4", precision="fp32", lora_dropout=0.1)),
])
def test_checkpointed_lora_layer_recompute(model, plan):
    """A checkpointed LoRA layer during its recompute: the checkpoint's copy of the layer input (half precision),
    the recomputed forward's locals where it stops (or at up_proj's adapter sum), and the gradients its backward made.
    Without them these peaks were 7.0 % (llama bf16), 5.6 % (llama bf16, dropout 0), 6.9 % (qwen2 bf16), 3.7 %
    (qwen3 bf16, dropout 0), 3.8 % (qwen3 QLoRA bf16) and 1.0 % (qwen3 QLoRA fp32) low; each is now within 600 bytes
    of ~2 MB (0.03 %). 0.2 % separates the two by far while leaving room for a few small tensors."""
    pytest.importorskip("torch")
    assert abs(_suite_error(model, **plan)) < 0.002


@pytest.mark.parametrize("model,dropout", [("llama-gqa", 0.05), ("qwen2", 0.05), ("qwen3", 0.0)])
def test_checkpointed_lora_layer_recompute_bf16_mixed(model, dropout):
    """bf16-mixed: were 8.8 % (llama), 6.3 % (qwen2) low. The peak is inside down_proj's lora_A mm; the scratch the
    CPU's bf16 gemm allocates there (0 to 16 KiB, by instruction set) is left out of the measurement
    (llmem/measure/kernels.py), so the same 0.2 % bound as the other recompute rows holds on every CPU."""
    pytest.importorskip("torch")
    err = _suite_error(model, method="lora", precision="bf16-mixed", lora_dropout=dropout)
    assert abs(err) < 0.002
