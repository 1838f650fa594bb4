"""Autocast's half weight copies under LoRA (bf16-/fp16-mixed outside FSDP's policies): which of them exist where.
Autocast caches the cast of a leaf fp32 weight that requires grad until the outermost autocast region exits
(`cached_cast`, aten/src/ATen/autocast_mode.cpp); a frozen base weight's cast is not cached, so it lives only where
an mm saved it. Past the forward's region only what autograd saved is left. Read through
`llmem.components.lora_activations` (and `llmem.components.lora`)."""

from __future__ import annotations

from llmem.components.lora import _module, _summary, is_lora, layer0_targeted, linear_weights
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec, per_spec

_GROUP_INPUT = {"q_proj": "input", "k_proj": "input", "v_proj": "input", "o_proj": "attention",
                "gate_proj": "residual", "up_proj": "residual", "down_proj": "down_proj input",
                "shared_expert_gate": "residual"}


@per_spec("layout_key")
def first_layer_unsaved_copy_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Autocast (bf16-/fp16-mixed, not FSDP2): a frozen base weight is not cached by autocast (it caches only leaves
    that require grad), so its half-precision copy lives only where mm saves it, for the input gradient: where the
    Linear's input requires grad. In layer 0 that is not so before the first adapted Linear (`_requires_grad`);
    these copies, counted for every layer by `autocast.layer_weight_copy_bytes`, do not exist there."""
    from llmem.components import autocast
    from llmem.components.lora_activations import _requires_grad, layer0_input_requires_grad

    if not is_lora(plan) or not autocast.layer_weight_copy_bytes(spec, plan) or layer0_input_requires_grad(spec, plan):
        return 0
    grad = _requires_grad(_layer_targets_short(spec, plan), first=True)
    unsaved = [p for p in linear_weights(spec) if p.layer == 0
               and not grad[_GROUP_INPUT.get(_module(p).rsplit(".", 1)[-1], "input")]]
    return sum(p.numel for p in unsaved) * plan.precision.compute_bytes


@per_spec("layout_key")
def layer_adapter_cast_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Autocast: the half-precision copies of one layer's adapter weights (fp32 leaves that require grad, so cached
    until the forward's autocast region exits, in checkpointed layers too); mixtral's expert-stack factors are
    not cast (`lora_experts.uncast_adapter_elements`)."""
    from llmem.components import autocast
    from llmem.components.lora_experts import uncast_adapter_elements

    if not is_lora(plan) or not autocast.applies(plan):  # (a 4-bit base has no copies of its own: quant_autocast)
        return 0
    return (_summary(spec, plan)[1][0] - uncast_adapter_elements(spec, plan)) * plan.precision.compute_bytes


def _layer_targets_short(spec: ModelSpec, plan: TrainingPlan) -> set[str]:
    return {_module(p).rsplit(".", 1)[-1] for p in layer0_targeted(spec, plan)}


@per_spec()
def unsaved_adapter_copy_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Autocast (bf16-/fp16-mixed, fp32 adapters): layer 0's lora_A half copies that no mm saved. Autocast caches the
    cast of a leaf fp32 weight that requires grad until the outermost autocast region exits (`cached_cast`,
    aten/src/ATen/autocast_mode.cpp; torch 2.13.0 `torch/amp/autocast_mode.py:348-349` clears the cache there), so
    each lora_A copy lives through the forward; past it only what autograd saved. `lora_A(x)` is an mm whose
    backward reads the weight only for the input's gradient (torch 2.13.0 `tools/autograd/derivatives.yaml`, `mm`:
    self's gradient reads mat2, mat2's reads self; a tensor is saved only for a gradient that is required), so where
    x needs no gradient (layer 0's Linears before the first adapted one, `_requires_grad`) the copy goes when the
    region exits, before backward; lora_B's input (lora_A's output) always requires grad, so its copy is saved.
    Rank × in-features × 2 bytes per such adapter; 0 where layer 0's input requires grad."""
    from llmem.components.lora_activations import _adapted_groups, _group_input_grad, layer0_input_requires_grad

    if not is_lora(plan) or not plan.precision.is_mixed or spec.derived is not None or spec.half_adapters \
            or layer0_input_requires_grad(spec, plan):
        return 0
    _, groups = _adapted_groups(spec, plan)
    return sum(plan.lora_rank * ins * 2 for (_, ins, _), grad in zip(groups, _group_input_grad(spec, plan, True),
                                                                         strict=True) if not grad)
