"""`--grad-accum K > 1`, micro-steps 2..K on one device (and DDP, ZeRO-1, TP): which of the gradients a decoder
layer's backward moment of micro-step 1 holds are not alive as new tensors at the same moment of micro-step 2
(`walk.accumulation.accumulation_phases` counts the rest as transient beside every `.grad`).

AccumulateGrad finds `.grad` defined and adds the new gradient in place (`variable_grad += new_grad` under no-grad,
torch/csrc/autograd/functions/accumulate_grad.h `accumulateGrad`); the new tensor is freed when the node returns.
"""

from __future__ import annotations

from llmem.components import lora, offload, weight_gradient
from llmem.components.gradients import in_buckets
from llmem.components.sharding import local_numel
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec


def _plain(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """Full fine-tuning of a dense table-driven model with its gradients on the device, outside DDP's bucket views."""
    return not (lora.is_lora(plan) or offload.offloads_gradients(plan) or in_buckets(plan) or spec.is_moe
                or spec.derived is not None)


def mlp_weight_gradient_released_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """At the MLP moment (`layer_backward_peak_extra_bytes`: the last MLP Linear's weight gradient, n
    intermediate-sized activation gradients and the layer output's), micro-step 2 holds no new weight gradient: it
    lives from its MmBackward0 (under autocast, its fp32 cast) until its AccumulateGrad, which the engine runs next
    (highest sequence number first, torch/csrc/autograd/engine.cpp `CompareNodeTaskTime`), before the activation's
    backward makes the other n - 1; that span is a moment of its own (`weight_gradient`: the weight gradient made,
    and cast). So the MLP moment holds the weight's bytes less."""
    if not _plain(spec, plan) or not weight_gradient.applies(spec, plan):
        return 0
    mlp = [p for p in spec.layer_params(0) if (".mlp." in p.name or ".fc" in p.name) and len(p.shape) >= 2]
    return local_numel(mlp[-1], plan) * plan.precision.param_bytes
