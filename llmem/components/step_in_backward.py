"""`--optimizer-in-backward`: each parameter's own optimizer steps inside backward (torchtune training/memory.py
`register_optim_in_bwd_hooks`; `llmem.runtime.optim.InBackward`).

One optimizer per trainable parameter, `Optimizer([p], ...)`; the post-accumulate-grad hook of `p` runs its `step()`
then `zero_grad()` (set_to_none). So:
  - gradients: a gradient lives from the node that makes it to its hook (`gradients.freed_at_hook`, the same
    accounting as `--ddp-bucket-view`): only the one just made, and a tied lm_head's waiting in the InputBuffer for
    the embedding's (its AccumulateGrad, and so its hook, runs once, after both arrived);
  - optimizer states: made lazily by each parameter's first step (iteration 1's backward); from then on all of them
    are alive — the steady state the walk models (iteration 2 holds at each moment what iteration 1 held, and every
    state);
  - step temporaries: those of a one-tensor step (`tensor_step_bytes`), on top of the backward moment where the
    tensor's gradient has just been made; no step or zero_grad phase after backward.
The backward moments that take a step are where the largest tensors' gradients are made: the lm_head's
(`head_step_bytes`), the embedding's at the end of backward (`embedding_step_bytes`), a decoder layer's last MLP
Linear's (`layer_step_bytes`; not LoRA's adapters, see `llmem.walk.layer._step_moment`).
"""

from __future__ import annotations

import math

from llmem.components import lora
from llmem.components.optimizer import adafactor_foreach_peak, adafactor_forloop_peak
from llmem.components.sharding import local_numel, tp_local_shape
from llmem.plan import Optimizer, OptimizerImpl, TrainingPlan
from llmem.spec import ModelSpec


def applies(plan: TrainingPlan) -> bool:
    return plan.optimizer_in_backward


def tensor_step_bytes(shape: tuple[int, ...], elem_bytes: int, plan: TrainingPlan) -> int:
    """The temporaries of an optimizer that holds one tensor of `shape` (elements of `elem_bytes`), torch 2.13:
    AdamW (torch/optim/adam.py) for-loop `denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)`, the sqrt and the
    quotient (2 tensors; no previous tensor's `denom`: the optimizer has no other), foreach
    `torch._foreach_sqrt(exp_avg_sqs)` (1), fused none; Adafactor (torch/optim/_adafactor.py) its one-tensor walk
    (`optimizer.adafactor_forloop_peak` / `adafactor_foreach_peak` of that tensor alone). SGD with momentum updates
    its buffer and the weight in place (torch/optim/sgd.py): none."""
    impl, n = plan.effective_optimizer_impl, math.prod(shape)
    if plan.optimizer is Optimizer.ADAFACTOR:
        peak = adafactor_foreach_peak if impl is OptimizerImpl.FOREACH else adafactor_forloop_peak
        return peak([shape]) * elem_bytes
    if plan.optimizer is not Optimizer.ADAMW:
        return 0
    return {OptimizerImpl.FORLOOP: 2, OptimizerImpl.FOREACH: 1}.get(impl, 0) * n * elem_bytes


def _outer_steps(spec: ModelSpec, plan: TrainingPlan, kind: str) -> int:
    """The largest step of the lm_head ("head") or the input embedding ("embed"): full fine-tuning's weight (tied:
    the shared one, as "embed"); LoRA's trainable copy of it (`--lora-modules-to-save`, same shape), none without
    one."""
    if lora.is_lora(plan) and not lora.trains_copy(spec, plan, kind):
        return 0
    params = [spec.outer_params[0]] if kind == "embed" else \
        [p for p in spec.outer_params if "lm_head" in p.name or "embed_out" in p.name]
    pb = plan.precision.param_bytes
    return max((tensor_step_bytes(tp_local_shape(p, plan.tp), pb, plan) for p in params), default=0)


def head_step_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The untied lm_head's step, once its weight gradient is made (tied: the shared weight steps at the end of
    backward)."""
    if not applies(plan) or spec.tie_word_embeddings:
        return 0
    return _outer_steps(spec, plan, "head")


def embedding_gradient_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The gradient its hook steps at the end of backward: the embedding's (tied: the InputBuffer's sum of the two,
    its addends freed); any other embedding's (GPT-2's positions) was made, stepped and freed before it (its
    EmbeddingBackward0 comes later in forward: the engine runs it first). LoRA: a trainable copy's, if any."""
    if lora.is_lora(plan):
        return lora.copy_bytes(spec, plan, "embed")
    return local_numel(spec.outer_params[0], plan) * plan.precision.param_bytes


def embedding_step_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The input embedding's step (tied: the shared weight's), the last of backward."""
    return _outer_steps(spec, plan, "embed") if applies(plan) else 0


def layer_step_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """A decoder layer's largest step under full fine-tuning: its largest tensor's."""
    if not applies(plan):
        return 0
    pb = plan.precision.param_bytes
    return max((tensor_step_bytes(tp_local_shape(p, plan.tp), pb, plan) for p in spec.layer_params(0)), default=0)


def moe_applies(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """A grouped-experts MoE layer (mixtral, qwen2_moe) under full fine-tuning, in backward."""
    return applies(plan) and spec.is_moe and spec.family.grouped_experts and not lora.is_lora(plan)


def moe_step_moment_bytes(spec: ModelSpec, plan: TrainingPlan) -> tuple[int, int]:
    """A grouped-experts MoE layer (`gradients.moe_layer_backward_moments`, symbols as there): (the moment's bytes,
    its step) at the largest of its moments, each less the expert gradients already stepped and freed by their hooks
    (`gradients.moe_held_gradient_bytes`). A hook runs once its node returned, the node's incoming gradient and saved
    input released: experts.down_proj's step (E × h × i) after the down grouped mm (less r × h and r × i, eb),
    experts.gate_up_proj's (E × 2i × h) after the gate_up one (less r × 2i and r × h, eb); the shared expert's
    largest Linear's (si × h) at its backward (nothing released counted)."""
    from llmem.components.gradients import moe_held_gradient_bytes, moe_layer_backward_moments

    h, e, eb = spec.hidden_size, spec.num_experts, plan.precision.param_bytes
    i = spec.moe_intermediate_size or spec.intermediate_size
    r = plan.batch_size * plan.seq_len * spec.experts_per_token
    steps = {"down grouped mm backward": ((e, h, i), r * h * eb + r * i * eb),  # (made, released)
             "gate_up grouped mm backward": ((e, 2 * i, h), r * 2 * i * eb + r * h * eb),
             "shared expert backward": ((spec.shared_expert_intermediate_size or 0, h), 0)}
    held, bytes_at = moe_held_gradient_bytes(spec, plan), moe_layer_backward_moments(spec, plan)
    moments = [(v - held.get(n, 0), 0) for n, v in bytes_at.items()]
    moments += [(bytes_at[n] - held.get(n, 0) - released, tensor_step_bytes(made, eb, plan))
                for n, (made, released) in steps.items() if math.prod(made)]
    return max(moments, key=sum)
