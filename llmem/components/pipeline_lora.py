"""`--pp N --method lora`: what a LoRA microbatch keeps on a pipeline stage (docs/MODEL-PIPELINE.md, "LoRA on the
stages"). The program (`runtime.pipeline.Stage`): PEFT's `get_peft_model` on the whole model, then each rank keeps
its stage's modules (the LoRA layers and their frozen base), as the one-GPU LoRA program but split; only the
adapters require grad, so the stage's parameters, gradients and optimizer states follow from its own spec
(`components.pipeline.stage_spec`) as the one-GPU terms do. The saved tensors are LoRA's (`lora_activations`):
a layer's table is the one of a layer whose input requires grad, except the first layer of stage 0, whose input (the
frozen embedding's output) does not; after stage 0 the input is a receive buffer that `PipelineStage` makes require
grad (torch 2.13.0 torch/distributed/pipelining/stage.py `_retrieve_recv_activations`: `requires_grad_(True)` for
backward), so every layer there keeps the full table."""

from __future__ import annotations

from llmem.plan import GradCkpt, TrainingPlan


def hand_lora(spec, q: TrainingPlan) -> bool:
    """Whether the hand-written LoRA tables apply (`walk.single._activation_terms`' `hand_lora`)."""
    from llmem.components import lora

    return lora.is_lora(q) and spec.derived is None


def kept_per_layer_bytes(spec, q: TrainingPlan) -> int:
    """What one decoder layer keeps from forward to backward (one microbatch, `q`): LoRA's table of a layer whose
    input requires grad (`lora_activations.layer_activation_bytes`), checkpointed its input as under full
    fine-tuning; otherwise `activations.kept_per_layer_bytes`."""
    from llmem.components import activations as act
    from llmem.components import lora

    if hand_lora(spec, q) and q.grad_ckpt is not GradCkpt.FULL:
        return lora.layer_activation_bytes(spec, q)
    return act.kept_per_layer_bytes(spec, q)


def first_layer_saving_bytes(spec, q: TrainingPlan) -> int:
    """How much less the model's layer 0 keeps than another layer (its input needs no gradient:
    `lora_activations.first_layer_saving_bytes`); 0 without LoRA or with checkpointing (PEFT's input-require-grads
    hook)."""
    from llmem.components import lora

    if not hand_lora(spec, q) or q.grad_ckpt is GradCkpt.FULL:
        return 0
    return lora.first_layer_saving_bytes(spec, q)


def stage_first_saving_bytes(spec, q: TrainingPlan, stage: int) -> int:
    """On stage 0 (with layers) the first layer's saving (`first_layer_saving_bytes`); after it none."""
    return first_layer_saving_bytes(spec, q) if stage == 0 else 0


def final_norm_bytes(spec, q: TrainingPlan) -> int:
    """The final norm's saved tensors; LoRA's frozen norm and lm_head save less (`lora_activations`)."""
    from llmem.components import activations as act
    from llmem.components import lora

    return lora.final_norm_bytes(spec, q) if hand_lora(spec, q) else act.final_norm_bytes(spec, q)


def first_layer_unsaved_copy_bytes(spec, q: TrainingPlan) -> int:
    """Autocast: the half copies of frozen base weights the model's layer 0 does not save (its input needs no
    gradient before the first adapted Linear: `lora_activations.first_layer_unsaved_copy_bytes`); 0 with the layer
    checkpointed (its recompute runs with the input-require-grads hook) or without LoRA."""
    from llmem.components import lora

    if not hand_lora(spec, q) or q.checkpointed(0):
        return 0
    return lora.first_layer_unsaved_copy_bytes(spec, q)


def first_layer_cached_copy_bytes(spec, q: TrainingPlan) -> int:
    """Autocast: the model's layer-0 lora_A copies no mm saved (their input needs no gradient), in autocast's cache
    until the stage forward returns (`lora_activations.unsaved_adapter_copy_bytes`); 0 with the layer checkpointed
    or without LoRA."""
    from llmem.components import lora

    if not hand_lora(spec, q) or q.checkpointed(0):
        return 0
    return lora.unsaved_adapter_copy_bytes(spec, q)


def stage_first_layer_bytes(spec, q: TrainingPlan, stage: int) -> int:
    """What a stage's first layer holds in its backward beyond the model's layer 0 (the one-GPU walk's first-layer
    moment): after stage 0 the whole LoRA table and the weight copies mm saved (`first_layer_saving_bytes`,
    `first_layer_unsaved_copy_bytes`); on stage 0 nothing."""
    if stage == 0:
        return 0
    return first_layer_saving_bytes(spec, q) + first_layer_unsaved_copy_bytes(spec, q)


def cached_copy_bytes(spec, q: TrainingPlan) -> int:
    """Autocast's cached half copies of one layer whose mm saved none (checkpointed): autocast caches only leaves
    that require grad, so under LoRA the adapters' (`lora_activations.layer_adapter_cast_bytes`), as the one-GPU
    walk's `fwd_casts`; otherwise the layer's weights (`autocast.layer_weight_copy_bytes`)."""
    from llmem.components import autocast, lora

    if hand_lora(spec, q) and autocast.layer_weight_copy_bytes(spec, q):
        return lora.layer_adapter_cast_bytes(spec, q)
    return autocast.layer_weight_copy_bytes(spec, q)
