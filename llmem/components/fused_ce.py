"""`--loss fused-linear-ce`: Liger-Kernel 0.8.5's fused linear cross-entropy. What runs: the model built as in
DESIGN.md section 1 after `liger_kernel.transformers.apply_liger_kernel_to_<family>(rope=False, rms_norm=False,
swiglu=False, cross_entropy=False, fused_linear_cross_entropy=True)`, so only the causal-LM forward changes: in
training with labels it skips `lm_head` (no logits in the output) and calls `LigerForCausalLMLoss`, i.e.
`LigerFusedLinearCrossEntropyFunction` (`ops/fused_linear_cross_entropy.py: fused_linear_cross_entropy_forward`).

With T = micro-batch × seq tokens, H hidden, V vocab, hb the hidden states' bytes (the final norm's output: fp32
under autocast and fp32, 2 in pure half), cb the compute bytes, pb the lm_head weight's bytes:
  chunks      inc_factor = ceil(V / H); chunk = min(next_pow2(ceil(T / inc_factor)), T) rows of tokens at a time
  forward     grad_input = zeros_like(hidden) T*H*hb, grad_weight = zeros_like(weight) V*H*pb, loss_1d T*4 (fp32),
              target_mask T (bool), the padded and shifted labels (T + batch)*8 + T*8 (`LigerForCausalLMLoss`);
              per chunk: logits chunk*V*cb (the cross-entropy kernel writes their gradient in place), then
              `grad_logits @ weight` chunk*H*cb copied into grad_input, and the weight-gradient accumulation:
              fp32 → legacy `torch.mm(grad_logits.t(), input_chunk).float()` (a V*H*4 temporary); bf16/fp16
              mixed (fp32 accumulator) → `addmm(out_dtype=float32)` with `input_chunk.to(half)` chunk*H*cb;
              pure half → `addmm(out=grad_weight)`, no temporary.
  after       grad_input and grad_weight are saved for backward (the loss_1d, labels and chunk buffers freed);
              backward returns them as they are (grad_output is 1.0); autograd releases the saved tensors before
              AccumulateGrad runs, so grad_weight becomes the lm_head's `.grad` without a copy.
Removed against the standard path (`llmem.components.logits`): the model output's logits, their fp32 upcast, the
log_softmax output and its two backward gradients, the softcap tanh output (gemma2: Liger applies the softcap
inside its kernel), and the lm_head backward's logits gradient and half weight gradient copy.
Not measurable here: Liger's kernels are Triton (CUDA); the plan rejects `--device cpu`.
"""

from __future__ import annotations

from llmem.components.logits import label_bytes
from llmem.components.saved import FP32
from llmem.plan import Loss, Precision, TrainingPlan
from llmem.spec import ModelSpec

# The families with an `apply_liger_kernel_to_<family>` in Liger-Kernel 0.8.5 (`Family.liger_kernel`) as the
# refusal lists them (its order predates the trait; a test keeps the two the same set).
LIGER_LISTED = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "mixtral", "phi3")


def is_fused(plan: TrainingPlan) -> bool:
    return plan.loss is Loss.FUSED_LINEAR_CE


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def chunk_rows(spec: ModelSpec, plan: TrainingPlan) -> int:
    tokens = plan.batch_size * plan.seq_len
    inc_factor = -(-spec.vocab_size // spec.hidden_size)
    return min(_next_pow2(-(-tokens // inc_factor)), tokens)


def hidden_bytes(plan: TrainingPlan) -> int:
    """Bytes per element of the final norm's output (the loss's input): the residual stream's dtype."""
    return plan.precision.param_bytes


def grad_input_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    return plan.batch_size * plan.seq_len * spec.hidden_size * hidden_bytes(plan)


def grad_weight_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    return spec.vocab_size * spec.hidden_size * plan.precision.param_bytes


def saved_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """grad_input and grad_weight, alive from the loss forward to its backward."""
    return grad_input_bytes(spec, plan) + grad_weight_bytes(spec, plan)


def chunk_peak_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The first (largest) chunk's buffers at its largest moment: its logits plus the larger of the grad_input
    product and the weight-gradient accumulation's temporary."""
    rows, h, v = chunk_rows(spec, plan), spec.hidden_size, spec.vocab_size
    cb = plan.precision.compute_bytes
    product = rows * h * cb
    if plan.precision is Precision.FP32:
        accumulate = v * h * FP32
    elif plan.precision.is_mixed:
        accumulate = rows * h * cb
    else:
        accumulate = 0
    return rows * v * cb + max(product, accumulate)


def loss_forward_peak_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    tokens = plan.batch_size * plan.seq_len
    return saved_bytes(spec, plan) + tokens * FP32 + tokens + label_bytes(spec, plan) + chunk_peak_bytes(spec, plan)
