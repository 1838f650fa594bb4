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
Linear's (`layer_step_bytes`).
"""

from __future__ import annotations

from llmem.components import lora
from llmem.components.sharding import local_numel
from llmem.plan import Optimizer, OptimizerImpl, TrainingPlan
from llmem.spec import ModelSpec


def applies(plan: TrainingPlan) -> bool:
    return plan.optimizer_in_backward


def tensor_step_bytes(nbytes: int, plan: TrainingPlan) -> int:
    """The temporaries of an optimizer that holds one tensor of `nbytes` (torch/optim/adam.py, torch 2.13), in its
    dtype: AdamW for-loop `denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)`, the sqrt and the quotient (2 tensors;
    no previous tensor's `denom`: the optimizer has no other); foreach `torch._foreach_sqrt(exp_avg_sqs)` (1); fused
    none. SGD with momentum updates its buffer and the weight in place (torch/optim/sgd.py): none."""
    if plan.optimizer is not Optimizer.ADAMW:
        return 0
    return {OptimizerImpl.FORLOOP: 2, OptimizerImpl.FOREACH: 1}.get(plan.effective_optimizer_impl, 0) * nbytes


def _outer_bytes(spec: ModelSpec, plan: TrainingPlan, kind: str) -> int:
    """The gradient bytes of the lm_head ("head") or the input embedding ("embed"): full fine-tuning's weight (tied:
    the shared one, as "embed"); LoRA's trainable copy of it (`--lora-modules-to-save`), none without one."""
    if lora.is_lora(plan):
        return lora.copy_bytes(spec, plan, kind)
    if kind == "embed":
        return local_numel(spec.outer_params[0], plan) * plan.precision.param_bytes
    heads = [p for p in spec.outer_params if "lm_head" in p.name or "embed_out" in p.name]
    return sum(local_numel(p, plan) for p in heads) * plan.precision.param_bytes


def head_step_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The untied lm_head's step, once its weight gradient is made (tied: the shared weight steps at the end of
    backward)."""
    if not applies(plan) or spec.tie_word_embeddings:
        return 0
    return tensor_step_bytes(_outer_bytes(spec, plan, "head"), plan)


def embedding_gradient_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The gradient its hook steps at the end of backward: the embedding's (tied: the InputBuffer's sum of the two,
    its addends freed); any other embedding's (GPT-2's positions) was made, stepped and freed before it (its
    EmbeddingBackward0 comes later in forward: the engine runs it first)."""
    return _outer_bytes(spec, plan, "embed")


def embedding_step_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The input embedding's step (tied: the shared weight's), the last of backward."""
    return tensor_step_bytes(embedding_gradient_bytes(spec, plan), plan) if applies(plan) else 0


def layer_step_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """A decoder layer's largest step: its largest trainable tensor's (LoRA: the largest adapter's, fp32)."""
    if not applies(plan):
        return 0
    if lora.is_lora(plan):
        return tensor_step_bytes(max(lora.adapter_sizes(spec, plan), default=0) * lora.ADAPTER_BYTES, plan)
    pb = plan.precision.param_bytes
    return max((tensor_step_bytes(local_numel(p, plan) * pb, plan) for p in spec.layer_params(0)), default=0)
