"""The last MLP Linear's weight gradient from its MmBackward0 to its AccumulateGrad.

The engine runs the weight's AccumulateGrad (and, under autocast, first the `ToCopyBackward0` of its half copy) right
after the Linear's MmBackward0, before the activation's backward makes the other intermediate-sized gradients
(highest sequence number first, torch 2.13 `torch/csrc/autograd/engine.cpp: CompareNodeTaskTime`; the weight's cast
is made after the activation in forward). Where the gradient is not kept as a `.grad` of its own after that —
`--ddp-bucket-view` (the Reducer's hook copies it into its bucket view, `gradients.in_buckets`), micro-steps 2..K of
`--grad-accum` (AccumulateGrad adds it into the `.grad` in place and frees it, `grad_accum`) — the layer's MLP moment
(`gradients.layer_backward_peak_extra_bytes`) holds no such gradient, and these moments come before it, each with
the layer output's gradient (tokens × h, param dtype) alive:
- the weight gradient made: MmBackward0 (`mm_mat1_backward` then `mm_mat2_backward`, tools/autograd/derivatives.yaml)
  has allocated the input gradient (tokens × i, compute dtype) and the weight gradient (in the compute dtype: half
  under autocast, where the node still holds the half weight copy it saved);
- under autocast, its fp32 cast: `ToCopyBackward0` allocates the fp32 gradient beside the half one; MmBackward0 has
  released what it saved (the half weight copy and its input, the activation's output, unless the activation saves
  that too: OPT's relu keeps its output), and its input gradient waits for the activation's backward.
Not LoRA (the frozen Linear makes no weight gradient), MoE layers (`gradients.moe_layer_backward_moments`), nor a
derived architecture (its traced backward has every moment).
"""

from __future__ import annotations

from llmem.components.gradients import freed_at_hook
from llmem.components.sharding import local_numel
from llmem.plan import Method, TrainingPlan
from llmem.spec import ModelSpec


def applies(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """Full fine-tuning of a dense table-driven model whose gradients stay on the device."""
    from llmem.components import offload

    return (plan.method is Method.FULL and not spec.is_moe and spec.derived is None and bool(_mlp_weights(spec))
            and not offload.offloads_gradients(plan))


def _mlp_weights(spec: ModelSpec) -> list:
    """Layer 0's MLP weight matrices, in the order of the inventory (kept on the spec)."""
    return spec.memo(("mlp weights",), lambda: [p for p in spec.layer_params(0)
                                                 if (".mlp." in p.name or ".fc" in p.name) and len(p.shape) >= 2])


def _terms(spec: ModelSpec, plan: TrainingPlan) -> tuple[int, int, int]:
    """(weight numel, one intermediate-sized gradient's bytes, the layer output gradient's bytes) on this rank."""
    tokens = plan.batch_size * plan.seq_len
    weight = local_numel(_mlp_weights(spec)[-1], plan)
    inter = tokens * (spec.intermediate_size // plan.tp) * plan.precision.compute_bytes
    return weight, inter, tokens * spec.hidden_size * plan.precision.param_bytes


def terms(spec: ModelSpec, plan: TrainingPlan) -> tuple[int, int, int]:
    """(the last MLP Linear's weight numel, one intermediate-sized gradient's bytes, the layer output gradient's bytes)
    on this rank; read by DeepSpeed's hook moments (`llmem.walk.deepspeed_hooks`)."""
    return _terms(spec, plan)


def last_mlp_weight_name(spec: ModelSpec) -> str:
    """Layer 0's last MLP weight matrix (the first whose gradient backward makes in a layer)."""
    return _mlp_weights(spec)[-1].name


def made_gradient_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Gradients in flight when MmBackward0 has made the weight gradient: the layer output's, the node's own input
    gradient where it is a tensor of its own (`output_gradient_bytes`), the input gradient and the weight gradient
    in the compute dtype."""
    weight, inter, residual = _terms(spec, plan)
    return residual + output_gradient_bytes(spec, plan) + inter + weight * plan.precision.compute_bytes


def output_gradient_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The gradient of the Linear's output (tokens × h, compute dtype), which MmBackward0 holds while it runs, where it
    is not the layer output's gradient itself: under autocast the engine casts the residual stream's gradient to the
    half output's dtype (torch/csrc/autograd/engine.cpp `validate_outputs`), and a dropout on the MLP output
    multiplies it by its noise or mask (a new tensor). Released when the node returns."""
    from llmem.components.activations import mlp_output_dropout_bytes
    from llmem.components.autocast import applies as autocast_applies

    if not (autocast_applies(plan) or mlp_output_dropout_bytes(spec, plan)):
        return 0
    return plan.batch_size * plan.seq_len * spec.hidden_size * plan.precision.compute_bytes


def cast_gradient_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Under autocast, at `ToCopyBackward0`: the layer output's gradient, the input gradient, the half weight gradient
    and its fp32 cast (param dtype)."""
    weight, inter, residual = _terms(spec, plan)
    return residual + inter + weight * (plan.precision.compute_bytes + plan.precision.param_bytes)


def stepped_gradient_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """At the weight's AccumulateGrad (`--optimizer-in-backward`: its hook's step): the layer output's gradient, the
    input gradient and the weight gradient in the parameter dtype (under autocast `ToCopyBackward0` has returned and
    freed the half one)."""
    weight, inter, residual = _terms(spec, plan)
    return residual + inter + weight * plan.precision.param_bytes


def cast_released_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The MLP's saved tensors MmBackward0 released before the cast: the activation's output (its input), unless the
    activation saves it too (`Family.mlp_activation` "relu": `ReluBackward0` keeps its result)."""
    return 0 if spec.family.mlp_activation == "relu" else _terms(spec, plan)[1]


def head_transient_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """`--ddp-bucket-view` or `--optimizer-in-backward` (`gradients.freed_at_hook`), untied: the lm_head's weight
    gradient from its MmBackward0 (fp32: its AccumulateGrad; autocast: its `ToCopyBackward0`) until its hook copies
    it into its bucket, or steps and frees it (tied: it waits in the InputBuffer,
    `gradients.bucket_view_pending_bytes`)."""
    if not freed_at_hook(plan) or spec.tie_word_embeddings:
        return 0
    if plan.method is not Method.FULL:  # LoRA: a trainable lm_head copy's (`--lora-modules-to-save lm_head`)
        from llmem.components import lora

        return lora.copy_bytes(spec, plan, "head")
    head = [p for p in spec.outer_params if "lm_head" in p.name or "embed_out" in p.name]
    return sum(local_numel(p, plan) for p in head) * plan.precision.param_bytes
