"""`--grad-accum K > 1`, micro-steps 2..K on one device (and DDP, ZeRO-1, TP): which of the gradients a decoder
layer's backward moment of micro-step 1 holds are not alive as new tensors at the same moment of micro-step 2
(`walk.accumulation.accumulation_phases` counts the rest as transient beside every `.grad`).

AccumulateGrad finds `.grad` defined and adds the new gradient in place (`variable_grad += new_grad` under no-grad,
torch/csrc/autograd/functions/accumulate_grad.h `accumulateGrad`); the new tensor is freed when the node returns.
"""

from __future__ import annotations

from llmem.components import lora, offload
from llmem.components.gradients import in_buckets, layer_backward_peak_extra_bytes
from llmem.components.sharding import local_numel
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec


def _plain(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """Full fine-tuning of a dense table-driven model with its gradients on the device, outside DDP's bucket views."""
    return not (lora.is_lora(plan) or offload.offloads_gradients(plan) or in_buckets(plan) or spec.is_moe
                or spec.derived is not None)


def mlp_weight_gradient_released_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """At the MLP moment (`layer_backward_peak_extra_bytes`: the last MLP Linear's weight gradient, n
    intermediate-sized activation gradients and the layer output's), micro-step 2 never holds all of them at once:
    the new weight gradient lives from its MmBackward0's return — when the only intermediate-sized gradient is that
    node's input gradient — until its AccumulateGrad, which the engine runs next (highest sequence number first,
    torch/csrc/autograd/engine.cpp `CompareNodeTaskTime`), before the activation's backward makes the other n - 1.
    So the moment is the larger of (weight + 1 of them) and (n of them): it holds min(weight, (n - 1) of them) less.
    One for the gelu MLPs (n = 1: no change), the weight for a gated MLP when (n - 1) × tokens × i ≥ its numel.
    Not GPT-2's `NewGELUActivation`: its composite's saved tensors, freed one by one by its backward, are all alive
    at the weight's moment (measured: that moment is above the later one by about the weight)."""
    if not _plain(spec, plan) or spec.family.mlp_activation == "gelu-new":
        return 0
    mlp = [p for p in spec.layer_params(0) if (".mlp." in p.name or ".fc" in p.name) and len(p.shape) >= 2]
    if not mlp:
        return 0
    tokens = plan.batch_size * plan.seq_len
    weight = local_numel(mlp[-1], plan) * plan.precision.param_bytes
    residual = tokens * spec.hidden_size * plan.precision.param_bytes
    one = tokens * (spec.intermediate_size // plan.tp) * plan.precision.compute_bytes
    others = layer_backward_peak_extra_bytes(spec, plan) - weight - residual - one  # the other n - 1
    return max(0, min(weight, others))
