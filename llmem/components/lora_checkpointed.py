"""LoRA under full checkpointing: what a checkpointed layer holds during its backward (its recompute's saves) and
what the layers keep from forward to backward under `--ckpt-every K`. The LoRA table is
`llmem.components.lora_activations`, which re-exports these terms; the recompute's moments beyond its saves are
`llmem.components.lora_recompute`."""

from __future__ import annotations

from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec, per_spec


@per_spec()
def recompute_bytes(spec: ModelSpec, plan: TrainingPlan, half: bool = False) -> int:
    """A checkpointed layer during its backward under LoRA: what its recompute saved again (the LoRA table), the
    checkpoint's own copy of the layer input where no op of the layer saves it (pure half precision:
    `checkpointed_input_extra_bytes`) and its forward RNG state (`half`: FSDP2 mixed, see `half_adapters`)."""
    from llmem.components import activations as act
    from llmem.components.lora_activations import layer_activation_bytes

    return act.recompute_bytes(spec, plan, layer_activation_bytes(spec, plan, half=half)
                               + act.checkpointed_input_extra_bytes(spec, plan))


@per_spec()
def kept_layers_bytes(spec: ModelSpec, plan: TrainingPlan, count: int, half: bool = False) -> int:
    """`--grad-ckpt full --ckpt-every K` under LoRA: what decoder layers 0 .. count-1 keep from forward to backward.
    The checkpointed ones (0, K, 2K, ...) their input and RNG state, as under full fine-tuning; the others the LoRA
    table (`layer_saved`) of a layer whose input requires grad (layer 0, the only one whose input does not, is
    always checkpointed)."""
    from llmem.components import activations as act
    from llmem.components.lora_activations import layer_activation_bytes
    from llmem.plan import GradCkpt

    if plan.grad_ckpt is not GradCkpt.FULL:
        return count * layer_activation_bytes(spec, plan, half=half)
    ckpt = -(-count // plan.ckpt_every)
    full = layer_activation_bytes(spec, act.layer_plan(plan, 1), half=half)
    return ckpt * (act.checkpointed_layer_bytes(spec, plan) + act.checkpoint_rng_state_bytes(plan)) \
        + (count - ckpt) * full


@per_spec()
def current_layer_backward_bytes(spec: ModelSpec, plan: TrainingPlan, layer: int, half: bool = False) -> int:
    """What layer `layer` holds while its own backward runs under LoRA with `--ckpt-every K`: checkpointed, what its
    recompute saves (`recompute_bytes`); otherwise its LoRA table."""
    from llmem.components import activations as act
    from llmem.components.lora_activations import layer_activation_bytes
    from llmem.plan import GradCkpt

    lp = act.layer_plan(plan, layer)
    if lp.grad_ckpt is GradCkpt.FULL:
        # qlora (no input-require-grads hook): layer 0's recompute is counted with the full table as before; the
        # measured layer-0 backward of s-qwen3-qlora-ckpt exceeds layer 1's, which the first-layer table would not
        # explain (not pinned down)
        return recompute_bytes(spec, lp, half)
    return layer_activation_bytes(spec, lp, half=half)
