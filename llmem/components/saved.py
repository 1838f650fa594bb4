"""The building blocks of every activation table: a saved tensor (`Saved`), a plan's dtype sizes, dropout, attention
(sdpa and eager), RMSNorm / LayerNorm and autocast's input casts, each as what autograd keeps for backward. The
per-family layer tables are in `llmem.components.layer_tables`; the walk's sums in `llmem.components.activations`.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmem.errors import InputError
from llmem.plan import Attention, Device, Precision, TrainingPlan
from llmem.spec import ModelSpec

FP32 = 4


@dataclass(frozen=True)
class Saved:
    """One tensor kept from forward to backward: `bytes` for the whole micro-batch on one rank."""

    name: str
    bytes: int


def _bytes(plan: TrainingPlan) -> tuple[int, int]:
    """(compute bytes, residual-stream bytes)."""
    return _BYTES[plan.precision]


def _precision_bytes(precision: Precision) -> tuple[int, int]:
    cb = precision.compute_bytes
    rb = 4 if precision in (Precision.FP32,) or precision.is_mixed else 2
    return cb, rb


_BYTES = {p: _precision_bytes(p) for p in Precision}


def _p(spec: ModelSpec, key: str) -> float:
    """A dropout probability (or fraction) from the config (`Family.extra`); 0 when the family has no such key."""
    value = spec.options.get(key)
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise InputError(key, f"must be a number between 0 and 1, got {value!r}")
    return float(value)


def _proj_dim(spec: ModelSpec) -> int:
    """OPT's word_embed_proj_dim: the width of project_out when the model has it (else hidden)."""
    for p in spec.outer_params:
        if p.name.endswith("project_out.weight"):
            return p.shape[0]
    return spec.hidden_size


def dropout_saved(name: str, plan: TrainingPlan, numel: int, elem_bytes: int, p: float) -> list[Saved]:
    """`nn.functional.dropout(x, p, training=True)` keeps, besides its output (a new tensor):
    CPU: `at::native::dropout` uses the fused kernel only on CUDA/XPU; `_dropout_impl` allocates
      `noise = empty_like(x).bernoulli_(1-p).div_(1-p)` in x's dtype and returns `x * noise`: mul saves the noise.
    CUDA: `native_dropout` returns (output, mask) with a bool mask (1 byte/element) saved by NativeDropoutBackward0.
    p == 0 returns x itself (nothing allocated)."""
    if not p:
        return []
    if plan.device is Device.CPU:
        return [Saved(f"{name} dropout noise", numel * elem_bytes)]
    return [Saved(f"{name} dropout mask (bool)", numel)]


def _flash(spec: ModelSpec, plan: TrainingPlan, key: str = "attention_dropout") -> bool:
    """Whether attention runs a fused sdpa kernel (not eager, not the CPU math fallback for dropout)."""
    return _sdpa(spec, plan) and (plan.device is Device.CUDA or not _p(spec, key))


def _sdpa(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """`--attn sdpa` on a model with an sdpa path (gemma2 and bloom run eager: `Family.sdpa`)."""
    from llmem.spec import attention_implementation

    return attention_implementation(spec.model_type, plan.attn) == Attention.SDPA.value


def attention_saved(spec: ModelSpec, plan: TrainingPlan, tokens: int, seq: int, sdpa_inputs: list[Saved],
                    p: float = 0.0, output_copy: bool = True, softcap: bool = False,
                    softmax_in_input_dtype: bool = False, fused_v_bytes: int = 0,
                    fused_qk_views: bool = False, kv_view_bytes: tuple[int, int] = (0, 0)) -> list[Saved]:
    """The attention core of one layer after the projections (q width = heads*head_dim on this rank).

    sdpa (`_scaled_dot_product_flash_attention_for_cpu` / CUDA flash or efficient): the family's q, k, v tensors
      (`sdpa_inputs`, views of fused projections where the family has them), output and fp32 logsumexp; attention
      dropout runs inside the CUDA kernels (philox state only). On CPU the flash kernel refuses dropout > 0
      (`check_for_dropout`): `_scaled_dot_product_attention_math` then upcasts half q/k/v to fp32 and saves
      q*sqrt(scale), k*sqrt(scale), v (bmm copies, full heads), the fp32 `_safe_softmax` output, the dropout noise
      and the dropped probabilities (all fp32), then casts the output back.
    eager (`eager_attention_forward`): q, k and v as bmm operands (contiguous full-head copies: repeat_kv output or
      the reshape of a transposed view), softmax in fp32 (its output saved by softmax and, in fp32, by the bmm),
      cast back to the compute dtype when half (saved by the bmm), dropout on the probabilities;
      gemma2's attention softcapping `tanh(scores / cap) * cap` saves the tanh output (TanhBackward0), in the
      scores' dtype: the compute dtype (the q·kᵀ matmul runs in half under autocast; div/tanh/mul keep it).
      `softmax_in_input_dtype` (gpt2: `softmax(w, dim=-1)` with no dtype, then `.type(value.dtype)`): the softmax
      runs in the scores' dtype — half in pure bf16/fp16, no cast after it — and in fp32 only where autocast
      promotes it (softmax is on autocast's fp32 list) or the model is fp32.
    The output transposed back and made contiguous is the o_proj input (`output_copy`).
    `fused_v_bytes`: v is a transposed view of a fused q/k/v output (phi3's qkv_proj, gpt_neox's query_key_value)
      no repeat_kv copies. `at::matmul` hands bmm `v.expand(...).reshape(b·heads, s, d)` (torch 2.13
      `aten/src/ATen/native/LinearAlgebra.cpp: _matmul_impl`), a view at micro-batch 1 (a size-1 batch dim merges
      whatever its stride): BmmBackward0 keeps the whole fused output, not a v-sized copy (from micro-batch 2 on, a
      copy). So does the CPU math path with an fp32 v (a half one is upcast, a copy). `fused_qk_views` (gpt2's c_attn
      split): q and kᵀ are such views too, so eager keeps the fused output once for all three.
    `kv_view_bytes` (k's, v's): one kv head on the rank (multi-query, GQA split by TP) at micro-batch 1: `repeat_kv`'s
      expand + reshape (transformers 5.23 `models/llama/modeling_llama.py`) and matmul's reshape are stride-0 views,
      k and v kept kv-wide (k after RoPE, v_proj's output); autocast's cast of an expanded fp32 k is a full copy (0)."""
    cb, _ = _bytes(plan)
    q, heads = spec.num_heads * spec.head_dim // plan.tp, spec.num_heads // plan.tp
    scores = tokens * heads * seq
    if _sdpa(spec, plan) and (not p or plan.device is Device.CUDA):  # fused kernel
        items = [*sdpa_inputs, Saved("sdpa output", tokens * q * cb), Saved("sdpa logsumexp", tokens * heads * FP32)]
        return items + ([Saved("attention output contiguous (o_proj input)", tokens * q * cb)] if output_copy else [])
    view = fused_v_bytes and plan.batch_size == 1  # the bmm operand reshaped from v is a view of the fused output
    if _sdpa(spec, plan):  # CPU math path
        v = Saved("math sdpa v (fp32 bmm operand)", tokens * q * FP32)
        if view and cb == FP32:  # not upcast (a copy) first
            v = Saved("math sdpa v (fp32 bmm operand, a view of the fused q/k/v output)", fused_v_bytes)
        return [Saved("math sdpa q*scale (fp32)", tokens * q * FP32),
                Saved("math sdpa k*scale (fp32)", tokens * q * FP32), v,
                Saved("math sdpa _safe_softmax output (fp32)", scores * FP32),
                *dropout_saved("math sdpa probabilities", plan, scores, FP32, p),
                Saved("math sdpa dropped probabilities (fp32 bmm operand)", scores * FP32),
                Saved("attention output contiguous (o_proj input)", tokens * q * cb)]
    items = _eager_operands(plan, tokens * q * cb, fused_v_bytes if view else 0, fused_qk_views, kv_view_bytes)
    if softcap:
        items.append(Saved("attention softcapping tanh output (compute dtype)", scores * cb))
    fp32_softmax = not softmax_in_input_dtype or plan.precision.is_mixed or cb == FP32
    items.append(Saved("softmax output (fp32)", scores * FP32) if fp32_softmax
                 else Saved("softmax output (compute dtype)", scores * cb))
    if p:  # the dropout input (the cast, when half) is not saved: mul/native_dropout keep only noise or mask
        items += [*dropout_saved("attention probabilities", plan, scores, cb, p),
                  Saved("dropped probabilities (bmm operand)", scores * cb)]
    elif cb != FP32 and fp32_softmax:
        items.append(Saved("probabilities cast to the compute dtype (bmm operand)", scores * cb))
    return items + [Saved("attention output contiguous (o_proj input)", tokens * q * cb)]


def _eager_operands(plan: TrainingPlan, q_bytes: int, fused_view: int, fused_qk_views: bool,
                    kv_view_bytes: tuple[int, int]) -> list[Saved]:
    """Eager attention's q, k and v bmm operands (`attention_saved`): full-head copies, or the views it documents."""
    items = [Saved("eager q (bmm operand)", q_bytes), Saved("eager k (bmm operand)", q_bytes),
             Saved("eager v (bmm operand)", q_bytes)]
    if fused_view and fused_qk_views:  # q, k and v: one fused output, released with the last of them (q·kᵀ's backward)
        return [Saved("eager q, k, v (bmm operands, views of the fused q/k/v output)", fused_view)]
    if fused_view:
        items[2] = Saved("eager v (bmm operand, a view of the fused q/k/v output)", fused_view)
    elif plan.batch_size == 1:
        for k, (what, nbytes) in enumerate(zip("kv", kv_view_bytes, strict=True), start=1):
            if nbytes:
                items[k] = Saved(f"eager {what} (bmm operand, a stride-0 view of one kv head)", nbytes)
    return items


def rms_norm_saved(name: str, spec: ModelSpec, plan: TrainingPlan, tokens: int, output_saved: bool) -> list[Saved]:
    """`LlamaRMSNorm.forward`: x.to(fp32); x * rsqrt(mean(x^2) + eps); weight * x.to(input_dtype)."""
    h = spec.hidden_size
    cb, rb = _bytes(plan)
    items = [Saved(f"{name}.rsqrt", tokens * FP32)]
    if rb == 2:  # pure half: the fp32 upcast is a copy saved by pow/mul; the product is cast back and saved
        items += [Saved(f"{name}.to_fp32", tokens * h * FP32), Saved(f"{name}.normalized", tokens * h * rb)]
    else:
        items += [Saved(f"{name}.normalized", tokens * h * rb)]
    if output_saved:
        items.append(Saved(f"{name}.output", tokens * h * rb))
    return items




def layer_norm_saved(name: str, plan: TrainingPlan, tokens: int, h: int) -> list[Saved]:
    """`nn.LayerNorm` (native_layer_norm saves its input, mean and rstd; fp32 under autocast). The output is saved
    by the following Linear — except under mixed precision, where that Linear saves its bf16 cast instead."""
    _, rb = _bytes(plan)
    items = [Saved(f"{name}.mean", tokens * FP32), Saved(f"{name}.rstd", tokens * FP32)]
    if not plan.precision.is_mixed:
        items.append(Saved(f"{name}.output", tokens * h * rb))
    return items


def _cast(plan: TrainingPlan, tokens: int, h: int, n: int, what: str) -> list[Saved]:
    return [Saved(f"autocast input cast {what}", n * tokens * h * 2)] if plan.precision.is_mixed and n else []


