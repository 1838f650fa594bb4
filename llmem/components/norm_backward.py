"""Gemma2's post-feedforward RMSNorm: the first op of its decoder layer's backward.

`Gemma2DecoderLayer` normalizes the MLP output (`post_feedforward_layernorm`) before the residual add, so that
norm's backward runs first in the layer's backward (autograd runs the node made last first), while every saved
tensor of the layer — after checkpointing, of its recompute — is still alive. `Gemma2RMSNorm` computes in fp32
(`x.float()`, `x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)`), and its backward's largest moment is
`pow_backward`: `grad * (2 * x.pow(1))` allocates three tokens × h fp32 tensors (`x.pow(1)`, the product with the
exponent, the product with the gradient) while mean's backward (`grad.expand(...) / h`, a fourth) is alive.
The MLP's own backward moment (`gradients.layer_backward_peak_extra_bytes`) comes after it: the norm's saved
tensors are released by then. Sources: transformers 5.23 `models/gemma2/modeling_gemma2.py`; torch 2.13
`tools/autograd/derivatives.yaml` (`pow.Tensor_Scalar: pow_backward`, `mean.dim: mean_backward`).
"""

from __future__ import annotations

from llmem.components.saved import FP32, Saved
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec, per_spec

POST_MLP_NORM = "post_feedforward_layernorm"
POW_BACKWARD_TEMPORARIES = 4  # mean's backward, x.pow(1), 2 * x.pow(1), grad * (2 * x.pow(1))


def applies(spec: ModelSpec) -> bool:
    return spec.family.sandwich_norms


def post_mlp_norm_saved_bytes(spec: ModelSpec, items: tuple[Saved, ...]) -> int:
    """What the post-feedforward norm saved (its fp32 input, rsqrt, normalized; not the (1+weight) vector, which
    the norm's weight gradient frees later): released before the MLP's backward moment."""
    if not applies(spec):
        return 0
    return sum(s.bytes for s in items if s.name.startswith(POST_MLP_NORM) and "weight" not in s.name)


@per_spec()
def post_mlp_norm_released_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """`post_mlp_norm_saved_bytes` of the layer's table under `plan`."""
    if not applies(spec):
        return 0
    from llmem.components.activations import layer_saved

    return post_mlp_norm_saved_bytes(spec, layer_saved(spec, plan))


def post_mlp_norm_backward_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The norm backward's temporaries beyond the layer's saved tensors and its output gradient: four tokens × h
    fp32 tensors (the norm runs in fp32 under every precision)."""
    if not applies(spec):
        return 0
    return POW_BACKWARD_TEMPORARIES * plan.batch_size * plan.seq_len * spec.hidden_size * FP32


def final_norm_backward_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The final RMSNorm's backward after the lm_head's (llama-like: `hidden.to(fp32) * rsqrt(...)`, in fp32 under
    every precision): at `pow_backward` its four temporaries (`POW_BACKWARD_TEMPORARIES`) beside mul's gradient
    for the normalized branch, `grad * rsqrt`, which waits to be summed with them: five tokens × h fp32 tensors.
    Modelled where the norm and lm_head are frozen (LoRA under FSDP1: no weight gradient beside them)."""
    return (POW_BACKWARD_TEMPORARIES + 1) * plan.batch_size * plan.seq_len * spec.hidden_size * FP32
