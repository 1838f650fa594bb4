"""lm-head logits and the cross-entropy loss (transformers 5.23.0 `loss/loss_utils.py: ForCausalLMLoss`).

With T = micro-batch × seq tokens, V = vocab (local to the rank), Lc = T*V*compute_bytes, L32 = T*V*4:
  forward   logits = lm_head(h): Lc, kept in the model output until the iteration ends (DESIGN.md section 1)
            logits.float(): a copy L32 when the logits are half (freed when the loss function returns)
            log_softmax output L32 (saved by nll_loss); labels padded (T + batch)*8 and shifted copy T*8
  softcap   gemma2 `final_logit_softcapping`: logits = tanh(logits / cap) * cap keeps the tanh output (Lc) until
            its backward (right after the loss's)
  backward  nll_loss_backward L32 and _log_softmax_backward_data L32 while the log_softmax output lives (the
            shifted labels nll_loss saved are released once its backward ran)
            lm_head: grad of logits (Lc), grad_weight V*h*compute_bytes (+ fp32 cast under mixed precision)
`--loss chunked-ce` (torchtune's chunked program) has terms of its own (`llmem.components.chunked_ce`), which each
function here returns for such a plan.
"""

from __future__ import annotations

from llmem.components import chunked_ce
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec

FP32, INT64 = 4, 8


def _sizes(spec: ModelSpec, plan: TrainingPlan) -> tuple[int, int, int]:
    tokens = plan.batch_size * plan.seq_len
    elems = tokens * spec.vocab_size
    return elems * plan.precision.compute_bytes, elems * FP32, tokens


def logits_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The model output's logits, alive from the lm_head forward to the end of the iteration."""
    if chunked_ce.is_chunked(plan):
        return chunked_ce.logits_bytes(spec, plan)
    return _sizes(spec, plan)[0]


def label_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """`nn.functional.pad(labels, (0, 1))` and `labels[..., 1:].contiguous()` (int64)."""
    if chunked_ce.is_chunked(plan):
        return chunked_ce.label_bytes(spec, plan)
    tokens = plan.batch_size * plan.seq_len
    return (tokens + plan.batch_size) * INT64 + tokens * INT64


def softcap_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """gemma2 (`Gemma2ForCausalLM.forward`): `tanh(logits / final_logit_softcapping)` saved by TanhBackward0."""
    return _sizes(spec, plan)[0] if spec.options.get("final_logit_softcapping") else 0


def loss_forward_peak_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Logits-related bytes at the end of cross_entropy's forward."""
    if chunked_ce.is_chunked(plan):
        return chunked_ce.loss_forward_peak_bytes(spec, plan)
    lc, l32, _ = _sizes(spec, plan)
    upcast = l32 if plan.precision.compute_bytes != FP32 else 0
    return lc + upcast + l32 + label_bytes(spec, plan) + softcap_bytes(spec, plan) + final_hidden_held_bytes(spec, plan)


def final_hidden_held_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The final hidden states (the lm_head's input: tokens × its input width, in the residual stream's dtype)
    while the loss's forward runs: `*ForCausalLM.forward` holds them (`hidden_states = outputs.last_hidden_state`,
    transformers 5.23 e.g. modeling_llama.py `LlamaForCausalLM.forward`) until it returns after the loss. Counted
    here only where the lm_head does not save that tensor for its backward: under autocast it saves its half copy;
    a frozen lm_head (LoRA, no trainable copy of it) saves no input. Measured: 32 KiB at 128 tokens × h 64, fp32."""
    from llmem.components import autocast, lora, lora_head
    from llmem.components.activations import _proj_dim
    from llmem.components.saved import _bytes

    frozen = lora.is_lora(plan) and not lora.trains_copy(spec, plan, "head")
    if lora_head.keeps_input(plan):  # an adapted lm_head's lora_A saves it (counted with the final norm's saves)
        return 0
    if not (autocast.applies(plan) or frozen):
        return 0
    return plan.batch_size * plan.seq_len * _proj_dim(spec) * _bytes(plan)[1]


def loss_backward_peak_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Logits-related bytes during `_log_softmax_backward_data`: logits, log_softmax output, two fp32 grads. The
    shifted labels are gone: nll_loss saved them as its target, and the engine releases a node's saved tensors
    once it has run (`Node::release_variables`, no retain_graph), before LogSoftmaxBackward0 runs."""
    if chunked_ce.is_chunked(plan):
        return chunked_ce.loss_backward_peak_bytes(spec, plan)
    lc, l32, _ = _sizes(spec, plan)
    return lc + 3 * l32 + softcap_bytes(spec, plan)


def lm_head_backward_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Logits and their gradient while the lm_head's backward runs (the weight gradient is counted with
    gradients, its half-precision copy under mixed precision as a temporary)."""
    if chunked_ce.is_chunked(plan):
        return chunked_ce.lm_head_backward_bytes(spec, plan)
    lc, _, _ = _sizes(spec, plan)
    return 2 * lc


def loss_backward_start_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Logits-related bytes when `loss.backward()` starts, before the loss's backward allocates its two fp32
    gradients: the logits, the log_softmax output and the shifted labels nll_loss saved."""
    if chunked_ce.is_chunked(plan):
        return chunked_ce.loss_backward_start_bytes(spec, plan)
    lc, l32, tokens = _sizes(spec, plan)
    return lc + l32 + tokens * INT64 + softcap_bytes(spec, plan)
