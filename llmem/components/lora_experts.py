"""LoRA `all-linear` on mixtral: PEFT 0.21 adapts the router and the fused experts as parameters.

Under transformers 5.23 mixtral's router (`MixtralTopKRouter.weight`, E × h) and experts (`MixtralExperts.
gate_up_proj`, E × 2i × h; `.down_proj`, E × h × i) are bare parameters, not Linears. PEFT rewrites the config for
them (`peft/utils/transformers_weight_conversion.py:44-45`, `_MOE_TARGET_MODULE_MAPPING` at 332-337,
`_resolve_string_target_modules` at 369-373, `_convert_peft_config_moe` at 402-482): `all-linear` adds
`target_parameters = {gate.weight, gate_up_proj, down_proj}` with rank and alpha doubled for the fused
`gate_up_proj` (`rank_pattern`, 474-479). Each becomes a `ParamWrapper` (`peft/tuners/lora/layer.py:2335`;
the experts' two are nested) with lora_A (r·E, in) and lora_B (out, r·E) (`update_layer`, 2455-2456; E = 1 for the
2-D router), fp32 like every adapter. PEFT refuses `lora_dropout > 0` there (2364-2366).

Forward (`ParamWrapper.forward`, 2698-2713; `_activate_lora`, 2571-2601): the wrapped parameter is replaced, for
the module's forward, by a parametrization cached once per forward (`nn.utils.parametrize.cached`):
  - experts (E > 1, not float8): `_LoraFactorsProxy` (2305-2323): `torch.baddbmm(W, lhs, rhs, alpha=scaling)`,
    a new E × out × in tensor in the weight's dtype (lhs, rhs are views of lora_B / lora_A, cast to the weight's
    dtype when it is half: `get_delta_factors`, 2525-2542). The grouped mm (transformers `integrations/moe.py:
    490`) then saves that whole stack and its input for the stack's gradient.
  - router (2-D): `_LoraParameterProxy(get_delta_weight)` (2271-2302; `Linear.get_delta_weight`, 1044-1072):
    `W + (B @ A) * scaling` (E × h); the router's `F.linear` saves it and its input.
Backward: each grouped mm makes the gradient of the whole stack (E × out × in, as full fine-tuning's weight
gradient) and `BaddbmmBackward0` turns it into the factors' gradients; it is freed then, not accumulated."""

from __future__ import annotations

from llmem.components.saved import Saved
from llmem.errors import GAP, InputError
from llmem.plan import ALL_LINEAR, TrainingPlan
from llmem.spec import ModelSpec, ParamTensor

# full-fine-tuning entries of `layer_tables.moe_saved` (and of the norm) the adapted stacks need again: the grouped
# mms' inputs, for the stacks' gradients, and the router's input (its fp32 / pure-half norm output, or its cast)
KEPT = frozenset({"gathered tokens (tokens × top_k)", "silu(gate) * up", "post_attention_layernorm.output",
                  "autocast input cast router"})


def adapts_experts(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """Whether PEFT adapts the router and fused experts (mixtral-like grouped experts without a shared expert,
    `all-linear`)."""
    from llmem.components.lora import is_lora

    return (is_lora(plan) and spec.family.grouped_experts and not spec.family.shared_expert
            and plan.lora_targets == ALL_LINEAR)


def v4_moe_name_refusal(spec: ModelSpec, target: str) -> None:
    """mixtral's transformers-4 names of its router and experts (gate, w1, w2, w3), which PEFT maps onto the router
    and the fused expert stacks (`_MOE_TARGET_MODULE_MAPPING`): modelled as part of all-linear only."""
    if spec.family.grouped_experts and not spec.family.shared_expert and target.rsplit(".", 1)[-1] in V4_NAMES:
        raise InputError("lora-targets", f"{target!r} on {spec.model_type} adapts the router or the fused experts "
                         "(PEFT's ParamWrapper), modelled as part of all-linear only; use all-linear (with "
                         "--lora-dropout 0) or the attention Linears", GAP)


V4_NAMES = ("gate", "w1", "w2", "w3")


def _dims(spec: ModelSpec) -> tuple[int, int, int]:
    return spec.hidden_size, spec.num_experts, spec.moe_intermediate_size or spec.intermediate_size


def adapter_params(spec: ModelSpec, plan: TrainingPlan) -> list[ParamTensor]:
    """The ParamWrappers' lora_A / lora_B in each layer (`update_layer`, layer.py:2455-2456): router r × h and
    E × r; gate_up_proj (rank 2r) 2rE × h and 2i × 2rE; down_proj rE × i and h × rE."""
    if not adapts_experts(spec, plan):
        return []
    h, e, i = _dims(spec)
    r = plan.lora_rank
    out = []
    for layer in range(spec.num_layers):
        m = f"model.layers.{layer}.mlp"
        out += [ParamTensor(f"{m}.gate.lora_A.default.weight", (r, h), layer),
                ParamTensor(f"{m}.gate.lora_B.default.weight", (e, r), layer),
                ParamTensor(f"{m}.experts.base_layer.lora_A.default.weight", (2 * r * e, h), layer),
                ParamTensor(f"{m}.experts.base_layer.lora_B.default.weight", (2 * i, 2 * r * e), layer),
                ParamTensor(f"{m}.experts.lora_A.default.weight", (r * e, i), layer),
                ParamTensor(f"{m}.experts.lora_B.default.weight", (h, r * e), layer)]
    return out


def uncast_adapter_elements(spec: ModelSpec, plan: TrainingPlan) -> int:
    """One layer's expert-stack factors, which autocast does not cast (hence does not cache): `_LoraFactorsProxy`
    runs its baddbmm with autocast disabled (layer.py:2322). The router's delta `B @ A` is an autocast mm."""
    if not adapts_experts(spec, plan):
        return 0
    h, e, i = _dims(spec)
    return plan.lora_rank * e * (2 * (h + 2 * i) + (i + h))


def saved(spec: ModelSpec, plan: TrainingPlan, half: bool = False) -> list[Saved]:
    """What one layer's adapted router and experts save beyond the frozen block's LoRA table (with `KEPT`): the
    materialised stacks (pb: the parameters' bytes; the grouped mm runs in the weights' dtype), the router's
    `W + delta` (its autocast cast under mixed precision), the router delta's `* scaling` (a 0-dim float64), and
    in pure half the factors' casts to the weight dtype that `BaddbmmBackward0` keeps (not with `half`: FSDP2's
    mixed-precision policy all-gathers the adapters in the half dtype too, `plan` then the pure-half plan)."""
    if not adapts_experts(spec, plan):
        return []
    h, e, i = _dims(spec)
    r, pb = plan.lora_rank, plan.precision.param_bytes
    items = [Saved("router W + (B @ A) * scaling (F.linear weight)", e * h * (2 if plan.precision.is_mixed else pb)),
             Saved("router delta: scaling (0-dim float64 saved by mul)", 8),
             Saved("experts gate_up_proj W + scaling * lhs @ rhs (baddbmm output)", e * 2 * i * h * pb),
             Saved("experts down_proj W + scaling * lhs @ rhs (baddbmm output)", e * h * i * pb)]
    if pb == 2 and not plan.precision.is_mixed and not half:
        items.append(Saved("gate_up_proj/down_proj lhs, rhs cast to the weight dtype (baddbmm saves)",
                           e * (2 * i * 2 * r + 2 * r * h + h * r + r * i) * pb))
    return items


def backward_moments(spec: ModelSpec, plan: TrainingPlan) -> dict[str, int]:
    """Full fine-tuning's MoE backward moments (`gradients.moe_layer_backward_moments`) with the stacks' gradients
    transient: the down stack's (E × h × i) is freed by its `BaddbmmBackward0` before `silu(gate) * up` runs
    backward, so the later moments do not hold it; the factors' gradients wait for their view nodes (made before
    the block's forward) and are small. The saved down stack is released with the down mm's node."""
    from llmem.components.gradients import moe_layer_backward_moments

    h, e, i = _dims(spec)
    down_grad = e * h * i * plan.precision.param_bytes
    moments = dict(moe_layer_backward_moments(spec, plan))
    for name in ("silu(gate) * up backward", "gate_up grouped mm backward"):
        moments[name] -= 2 * down_grad  # the down stack's gradient and the saved stack, both freed
    return moments
