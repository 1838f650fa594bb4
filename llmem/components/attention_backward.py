"""Two moments of the attention's backward that the LayerNorm decoders' walk lacked (the llama-like families have
theirs in `query_backward`): the fused sdpa kernel's backward, and the backward of the bmm that multiplies dropped
attention probabilities by v (eager attention or sdpa's CPU math path with attention dropout > 0).

Autograd runs the ops made last first (`ReadyQueue` ordered by sequence_nr, torch 2.13
`torch/csrc/autograd/engine.cpp`), so when the attention core runs backward the MLP, the post-attention norm and the
output projection have run theirs: their saved tensors are released (`Node::release_variables` after each node), their
weight gradients made (`attention_core.eager_core_layer_gradient_bytes`), and the residual stream's gradient waits in
the layer input's InputBuffer (tokens × h, parameter dtype). A node's saved tensors go only after its own backward
returned, so at each moment below the node's inputs, saved tensors and outputs are alive together.

- Fused sdpa (`_scaled_dot_product_flash_attention_for_cpu_backward`, CUDA flash / efficient): it allocates q's, k's
  and v's gradients while its output's gradient (the output projection's input gradient) and everything it saved
  (q, k, v or the fused projection they view, output, logsumexp) are alive: `query_backward.sdpa_transient_bytes`.
  GPT-2 (`GPT2Attention`, c_attn split into q/k/v views), GPT-NeoX (`GPTNeoXAttention`, query_key_value and the
  partial-rotary `cat`s), OPT (`OPTAttention`, q_proj · scaling, k_proj, v_proj): transformers 5.23
  `models/{gpt2,gpt_neox,opt}/modeling_*.py` through `integrations/sdpa_attention.py`.
- The probabilities' bmm (`attn @ v` after dropout): `bmm`'s backward (torch 2.13
  `tools/autograd/derivatives.yaml`: `self: grad.bmm(mat2.transpose(1, 2))`, `mat2: self.transpose(1, 2).bmm(grad)`)
  allocates the probabilities' gradient (batch × heads × seq², the operand's dtype) and v's (tokens × q width) while
  its saved operands and the softmax output and dropout noise (saved by `_softmax` and the dropout's `mul`) are
  alive, and the gradient of its output (tokens × q width in the operand's dtype: the math path's fp32, whose cast
  back to half has run backward). The softmax backward (`attention_core`) comes after the dropout's `mul` backward,
  with one probability-sized tensor fewer (the dropped probabilities and the noise released): with dropout this
  moment is the larger. CPU dropout is `input * noise` (torch 2.13 `aten/src/ATen/native/Dropout.cpp`, `_dropout`),
  its noise saved by the `mul`; sdpa's CPU math path (`_scaled_dot_product_attention_math`,
  `aten/src/ATen/native/transformers/attention.cpp`) runs when dropout > 0 (the CPU flash kernel refuses it).
"""

from __future__ import annotations

from llmem.components import attention_core as core
from llmem.components.query_backward import applies_rope, sdpa_transient_bytes
from llmem.components.saved import FP32, Saved, _bytes, _sdpa
from llmem.plan import Method, TrainingPlan
from llmem.spec import ModelSpec

_LSE = "sdpa logsumexp"
_DROPPED = ("dropped probabilities (bmm operand)", "math sdpa dropped probabilities")
_MATH = "math sdpa "


def _hand_full(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """Full fine-tuning on a hand-written table (LoRA's tables and the traced architectures have their own)."""
    return plan.method is Method.FULL and spec.derived is None


def _after(items: tuple[Saved, ...], k: int) -> int:
    """Bytes of the items after index `k` (but the pre-attention ones a family appends last)."""
    return sum(s.bytes for s in items[k + 1:] if not s.name.startswith(core._APPENDED_BEFORE))


def _residual(spec: ModelSpec, plan: TrainingPlan) -> int:
    return plan.batch_size * plan.seq_len * spec.hidden_size * plan.precision.param_bytes


# --- the fused sdpa kernel's backward ---


def sdpa_applies(spec: ModelSpec, plan: TrainingPlan, items: tuple[Saved, ...]) -> bool:
    """A LayerNorm decoder (GPT-2, GPT-NeoX, OPT: not falcon's own attention, not bloom's eager one) whose layer
    table has the fused kernel's logsumexp; the llama-like families' moment is `query_backward`'s."""
    f = spec.family
    return (_hand_full(spec, plan) and f.norm == "layer" and not f.own_attention_core and _sdpa(spec, plan)
            and not applies_rope(spec, plan) and any(s.name.startswith(_LSE) for s in items))


def sdpa_released(items: tuple[Saved, ...]) -> int:
    """The saved tensors released before the kernel's backward: those of the ops after it (the table lists them
    after its logsumexp: the output projection's input copy, the dropouts, the post-attention norm, the MLP)."""
    k = next(i for i, s in enumerate(items) if s.name.startswith(_LSE))
    return _after(items, k)


def sdpa_transient(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Its output's gradient, q's, k's and v's (compute dtype) and the residual stream's
    (`query_backward.sdpa_transient_bytes`)."""
    return sdpa_transient_bytes(spec, plan)


# --- the dropped probabilities' bmm backward ---


def _dropped_index(items: tuple[Saved, ...]) -> int | None:
    return next((k for k, s in enumerate(items) if s.name.startswith(_DROPPED)), None)


def probs_applies(spec: ModelSpec, plan: TrainingPlan, items: tuple[Saved, ...]) -> bool:
    """Attention dropout on the eager path or sdpa's CPU math path, on a hand-written full-model table (not falcon's
    old architecture, whose math path has its own moment, `layer_tables.attention_backward_*`)."""
    return (_hand_full(spec, plan) and not spec.family.own_attention_core
            and _dropped_index(items) is not None)


def probs_released(items: tuple[Saved, ...]) -> int:
    """The saved tensors released before the bmm's backward: those of the ops after it."""
    return _after(items, _dropped_index(items))


def probs_transient(spec: ModelSpec, plan: TrainingPlan, items: tuple[Saved, ...]) -> int:
    """The probabilities' gradient (the dropped probabilities' bytes), v's gradient and the bmm output's gradient
    (tokens × q width each, fp32 on the math path, else the compute dtype) and the residual stream's."""
    dropped = items[_dropped_index(items)]
    width = FP32 if dropped.name.startswith(_MATH) else _bytes(plan)[0]
    q = plan.batch_size * plan.seq_len * spec.num_heads * spec.head_dim // plan.tp
    return dropped.bytes + 2 * q * width + _residual(spec, plan)


def moments(spec: ModelSpec, plan: TrainingPlan, layer_plan: TrainingPlan,
            items: tuple[Saved, ...]) -> list[tuple[str, int, int]]:
    """(name, saved bytes released, transient bytes) of each moment that applies to a layer of `layer_plan` whose
    saved tensors are `items`: the fused sdpa kernel's backward, the dropped probabilities' bmm backward."""
    out = []
    if sdpa_applies(spec, plan, items):
        out.append(("sdpa backward", sdpa_released(items), sdpa_transient(spec, layer_plan)))
    if probs_applies(spec, plan, items):
        out.append(("probabilities' bmm backward", probs_released(items), probs_transient(spec, layer_plan, items)))
    return out
