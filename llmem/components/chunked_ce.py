"""`--loss chunked-ce`: torchtune 0.6.1's chunked-output cross-entropy in eager mode (`llmem.runtime.chunked`: the
lm_head per chunk, `TransformerDecoder.chunked_output`; `CEWithChunkedOutputLoss.forward` and
`compute_cross_entropy`; `_loss_step`'s `del logits` before backward), as eager autograd allocates and saves it.

`torch.chunk(s, N)` cuts the sequence into chunks of ceil(s / N) tokens (the last shorter, maybe fewer than N); chunk
k has e_k = batch × s_k × V logits. cb: compute bytes, hb: the hidden states' bytes (the parameters' dtype).
  forward   every chunk's logits e_k*cb stay in the list until the loss returns; per chunk in turn: `.float()`
            e_k*4 (half only, transient) and the log_softmax output e_k*4, saved by nll_loss — all chunks' saved
            together until backward (the upcast of only one chunk at a time is the whole saving without compile);
            labels: hstack's shifted copy, then per chunk `reshape(-1)` copies (batch > 1), T*8 in all
  backward  the chunks' loss backward first, last chunk first (autograd's ready queue runs the higher sequence
            number first, and each chunk's loss nodes were made after every lm_head chunk): chunk k's
            nll_loss_backward and _log_softmax_backward_data (2 e_k*4) beside the saved outputs of chunks <= k and
            the logits gradients (e_j*cb) of chunks > k; then the lm_head per chunk: its weight gradient V*H*cb is
            summed into one buffer, the first sum (chunks n-1 and n-2) out of place (both parts and the sum
            alive), while the logits gradients of the chunks below wait
  after     nothing: the logits were dropped before backward, the saved outputs freed by their nodes
"""

from __future__ import annotations

from llmem.components import autocast, lora
from llmem.plan import Loss, TrainingPlan
from llmem.spec import ModelSpec

FP32, INT64 = 4, 8


def is_chunked(plan: TrainingPlan) -> bool:
    return plan.loss is Loss.CHUNKED_CE


def chunk_tokens(plan: TrainingPlan) -> list[int]:
    """Tokens per chunk: `hidden.chunk(N, dim=1)` (torch's `chunk`: ceil(s / N) per chunk, n = ceil(s / size) of
    them, the last the rest). Written with the count apart, so a replayed walk (`llmem.walk.replay`) holds for every
    length that makes as many chunks."""
    s, size = plan.seq_len, -(-plan.seq_len // plan.loss_chunks)
    n = -(-s // size)
    return [plan.batch_size * size] * (n - 1) + [plan.batch_size * (s - (n - 1) * size)]


def _elements(spec: ModelSpec, plan: TrainingPlan) -> list[int]:
    return [tokens * spec.vocab_size for tokens in chunk_tokens(plan)]


def logits_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Logits alive after the loss: none (`_loss_step`: `del logits` before `loss.backward()`)."""
    return 0


def all_logits_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Every chunk's logits (compute dtype), the list `chunked_output` returns, until the loss returns."""
    return sum(_elements(spec, plan)) * plan.precision.compute_bytes


def head_backward_start_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """When the lm_head's backward starts (after every chunk's loss backward): every chunk's logits gradient."""
    return all_logits_bytes(spec, plan)


def label_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """`torch.hstack((labels[..., 1:], ignore))` (int64), then each chunk's `reshape(-1)` copy saved by nll_loss."""
    return plan.batch_size * plan.seq_len * INT64


def loss_forward_peak_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """At chunk k's log_softmax (`compute_cross_entropy`): every chunk's logits, the saved log_softmax outputs of
    chunks < k, chunk k's fp32 upcast (half only) and its log_softmax output."""
    e, cb = _elements(spec, plan), plan.precision.compute_bytes
    upcast = FP32 if cb != FP32 else 0
    most = max(sum(e[:k]) * FP32 + e[k] * (FP32 + upcast) for k in range(len(e)))
    return sum(e) * cb + most + label_bytes(spec, plan)


def loss_backward_start_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """When `loss.backward()` starts: every chunk's saved log_softmax output and the labels nll_loss saved."""
    return sum(_elements(spec, plan)) * FP32 + label_bytes(spec, plan)


def loss_backward_peak_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """At chunk k's `_log_softmax_backward_data` (k = n-1 first): the saved outputs of chunks <= k, the logits
    gradients (compute dtype, after the upcast's ToCopyBackward) of chunks > k, chunk k's two fp32 gradients."""
    e, cb = _elements(spec, plan), plan.precision.compute_bytes
    most = max(sum(e[:k + 1]) * FP32 + sum(e[k + 1:]) * cb + 2 * e[k] * FP32 for k in range(len(e)))
    return most + label_bytes(spec, plan)


def frozen_head(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """LoRA's lm_head is frozen unless `--lora-modules-to-save lm_head` trains a copy of it, which then runs the
    chunks (PEFT's `ModulesToSaveWrapper` is the module `chunked_output` calls, `llmem.runtime.chunked`)."""
    return lora.is_lora(plan) and not lora.trains_copy(spec, plan, "head")


def head_weight_copies(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Autocast's half copies of the lm_head weight alive from the lm_head's forward to its backward: one (cached
    for the chunks), except for a frozen lm_head (LoRA): autocast caches only the casts of leaves that require grad
    (`aten/src/ATen/autocast_mode.cpp` `cached_cast`), so each chunk casts it anew and its MmBackward0 saves that copy
    (all n chunks' until their backward)."""
    return len(chunk_tokens(plan)) if is_chunked(plan) and frozen_head(spec, plan) else 1


def head_weight_gradient_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """One chunk's lm_head weight gradient (MmBackward0's, compute dtype: under autocast the cached half weight
    copy's); a frozen head (LoRA) makes none."""
    if frozen_head(spec, plan):
        return 0
    return spec.vocab_size * spec.hidden_size * plan.precision.compute_bytes


def _input_gradient(spec: ModelSpec, plan: TrainingPlan, tokens: int, cast: bool, freed: bool) -> int:
    """A chunk's input gradient (hb; cb before the autocast input cast's ToCopyBackward), less its saved input once
    MmBackward0 has returned (`freed`) when that input is a copy (a non-contiguous chunk, batch > 1, or autocast's
    cast)."""
    copies = freed and (plan.batch_size > 1 or plan.precision.is_mixed)
    grad = plan.precision.compute_bytes if cast else plan.precision.param_bytes
    return tokens * spec.hidden_size * (grad - plan.precision.compute_bytes * copies)


def lm_head_backward_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The lm_head's backward, beyond the one weight gradient the walk counts (and, under autocast, its weight copy):
    at chunk n-1's MmBackward0 every chunk's logits gradient and its input gradient; at chunk n-2's the second weight
    gradient beside the first, with the logits gradients of chunks <= n-2; at the first sum of two chunks' weight
    gradients (InputBuffer: `old + new`, out of place) the logits gradients of the chunks below and two more weight
    gradients. With two chunks that sum comes after the last MmBackward0 has returned, which released what the
    lm_head's nodes saved (`_released_before_sum`)."""
    e, cb, tokens = _elements(spec, plan), plan.precision.compute_bytes, chunk_tokens(plan)
    first = sum(e) * cb + _input_gradient(spec, plan, tokens[-1], True, False)
    wg = head_weight_gradient_bytes(spec, plan)
    if len(e) < 2 or not wg:
        return first
    done = _input_gradient(spec, plan, tokens[-1], False, True)  # chunk n-1's, after its ToCopyBackward0
    second = sum(e[:-1]) * cb + wg + done + _input_gradient(spec, plan, tokens[-2], True, False)
    summed = sum(e[:-2]) * cb + 2 * wg + done + _input_gradient(spec, plan, tokens[-2], True, True)
    return max(first, second, summed - _released_before_sum(spec, plan))


def _released_before_sum(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Two chunks: at the sum of their weight gradients no lm_head node is left, so autocast's half weight copy (saved
    by the chunks' MmBackward0 alone; the cache was cleared when the forward's autocast region exited) and, where the
    chunks' inputs are views of the final norm output (batch 1, no autocast cast), that output are gone (torch 2.13
    `torch/csrc/autograd/engine.cpp`: a node's saved variables are released after it runs, `release_variables`)."""
    if len(chunk_tokens(plan)) != 2:
        return 0
    views = plan.batch_size == 1 and not plan.precision.is_mixed
    return autocast.head_weight_copy_bytes(spec, plan) + views * plan.batch_size * plan.seq_len * spec.hidden_size * \
        plan.precision.compute_bytes
