"""Activations: the tensors a decoder layer's forward keeps alive for its backward (autograd saved tensors).

Each entry is one tensor the real step allocates, named after the op that allocates it, sized per token
(tokens = micro-batch × seq_len) — read from transformers 5.23.0 `modeling_llama.py` and the autograd formulas
of the ops (a mul saves the operand the other's gradient needs; `.to()` and `+` save nothing).

Llama-family layer, sdpa (cb = compute-dtype bytes, rb = residual-stream bytes: 4 for fp32 and mixed, 2 for pure):
  RMSNorm   fp32 input copy (pure half only) 4h, rsqrt 4, normalized h*rb|2h, weight*x output (not under autocast)
  attention q_embed, k_embed (RoPE output), v, sdpa output: (2q + 2kv)*cb; sdpa logsumexp: heads*4
  eager     + scores and probabilities, 2 * heads * seq * 4 bytes (fp32 softmax), repeat_kv copies of k and v
  MLP       gate, silu(gate), up, silu*up: 4i*cb
  autocast  (mixed) each Linear casts its input to the half dtype: q, k, v, gate, up: 5 copies of h*2
The residual stream (layer input) is saved by the next RMSNorm's pow when it is already fp32 (fp32, mixed).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from llmem.errors import InputError
from llmem.plan import Attention, Device, GradCkpt, Precision, TrainingPlan
from llmem.spec import ModelSpec

FP32 = 4


@dataclass(frozen=True)
class Saved:
    """One tensor kept from forward to backward: `bytes` for the whole micro-batch on one rank."""

    name: str
    bytes: int


def _bytes(plan: TrainingPlan) -> tuple[int, int]:
    """(compute bytes, residual-stream bytes)."""
    cb = plan.precision.compute_bytes
    rb = 4 if plan.precision in (Precision.FP32,) or plan.precision.is_mixed else 2
    return cb, rb


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
    """`--attn sdpa` on a model with an sdpa path (gemma2 and bloom run eager: `spec.EAGER_ONLY`)."""
    from llmem.spec import attention_implementation

    return attention_implementation(spec.model_type, plan.attn) == Attention.SDPA.value


def attention_saved(spec: ModelSpec, plan: TrainingPlan, tokens: int, seq: int, sdpa_inputs: list[Saved],
                    p: float = 0.0, output_copy: bool = True, softcap: bool = False) -> list[Saved]:
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
    The output transposed back and made contiguous is the o_proj input (`output_copy`)."""
    cb, _ = _bytes(plan)
    q, heads = spec.num_heads * spec.head_dim // plan.tp, spec.num_heads // plan.tp
    scores = tokens * heads * seq
    if _sdpa(spec, plan) and (not p or plan.device is Device.CUDA):  # fused kernel
        items = [*sdpa_inputs, Saved("sdpa output", tokens * q * cb), Saved("sdpa logsumexp", tokens * heads * FP32)]
        return items + ([Saved("attention output contiguous (o_proj input)", tokens * q * cb)] if output_copy else [])
    if _sdpa(spec, plan):  # CPU math path
        return [Saved("math sdpa q*scale (fp32)", tokens * q * FP32),
                Saved("math sdpa k*scale (fp32)", tokens * q * FP32),
                Saved("math sdpa v (fp32 bmm operand)", tokens * q * FP32),
                Saved("math sdpa _safe_softmax output (fp32)", scores * FP32),
                *dropout_saved("math sdpa probabilities", plan, scores, FP32, p),
                Saved("math sdpa dropped probabilities (fp32 bmm operand)", scores * FP32),
                Saved("attention output contiguous (o_proj input)", tokens * q * cb)]
    items = [Saved("eager q (bmm operand)", tokens * q * cb), Saved("eager k (bmm operand)", tokens * q * cb),
             Saved("eager v (bmm operand)", tokens * q * cb)]
    if softcap:
        items.append(Saved("attention softcapping tanh output (compute dtype)", scores * cb))
    items.append(Saved("softmax output (fp32)", scores * FP32))
    if p:  # the dropout input (the cast, when half) is not saved: mul/native_dropout keep only noise or mask
        items += [*dropout_saved("attention probabilities", plan, scores, cb, p),
                  Saved("dropped probabilities (bmm operand)", scores * cb)]
    elif cb != FP32:
        items.append(Saved("probabilities cast to the compute dtype (bmm operand)", scores * cb))
    return items + [Saved("attention output contiguous (o_proj input)", tokens * q * cb)]


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


def llama_layer_saved(spec: ModelSpec, plan: TrainingPlan, tokens: int, seq: int) -> list[Saved]:
    """Saved tensors of one llama-family decoder layer on one rank (TP shards heads and intermediate)."""
    h, tp = spec.hidden_size, plan.tp
    q = spec.num_heads * spec.head_dim // tp
    kv = spec.num_kv_heads * spec.head_dim // tp
    i = spec.intermediate_size // tp
    cb, rb = _bytes(plan)
    mixed = plan.precision.is_mixed
    items: list[Saved] = []
    if rb == 4:
        items.append(Saved("input (residual stream)", tokens * h * rb))
    items += rms_norm_saved("input_layernorm", spec, plan, tokens, output_saved=not mixed)
    if mixed:
        items.append(Saved("autocast input casts q/k/v", 3 * tokens * h * 2))
    sdpa_inputs = [Saved("q_embed (RoPE)", tokens * q * cb), Saved("k_embed (RoPE)", tokens * kv * cb),
                   Saved("v_proj", tokens * kv * cb)]
    items += attention_saved(spec, plan, tokens, seq, sdpa_inputs, _p(spec, "attention_dropout"), output_copy=False,
                             softcap=bool(spec.options.get("attn_logit_softcapping")))
    if rb == 4:
        items.append(Saved("residual after attention", tokens * h * rb))
    items += rms_norm_saved("post_attention_layernorm", spec, plan, tokens, output_saved=not mixed)
    if mixed:
        items.append(Saved("autocast input casts gate/up", 2 * tokens * h * 2))
    items += [
        Saved("gate_proj", tokens * i * cb),
        Saved("silu(gate)", tokens * i * cb),
        Saved("up_proj", tokens * i * cb),
        Saved("silu(gate) * up", tokens * i * cb),
    ]
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


def gpt2_layer_saved(spec: ModelSpec, plan: TrainingPlan, tokens: int, seq: int) -> list[Saved]:
    """`models/gpt2/modeling_gpt2.py: GPT2Block`. Conv1D is `addmm(bias, x, W)`; with a fused sdpa kernel c_attn's
    (tokens, 3h) output stays alive through the q/k/v views sdpa saves (the output's reshape is a view, c_proj's
    input); eager and the CPU math path copy q/k/v instead (`attention_saved`). attn_pdrop on the
    probabilities, resid_pdrop after c_proj (attention) and after the MLP. GPT2MLP's gelu_new
    0.5*x*(1+tanh(c*(x+0.044715*x^3))) saves x, 0.5*x, tanh, 1+tanh, and the product (c_proj's input): 5 × inner."""
    h, i = spec.hidden_size, spec.intermediate_size
    cb, rb = _bytes(plan)
    q = spec.num_heads * spec.head_dim
    resid = _p(spec, "resid_pdrop")
    return [
        Saved("input (residual stream, ln_1 input)", tokens * h * rb),
        *layer_norm_saved("ln_1", plan, tokens, h), *_cast(plan, tokens, h, 1, "c_attn"),
        *attention_saved(spec, plan, tokens, seq, [Saved("c_attn output (q, k, v views)", tokens * 3 * q * cb)],
                         _p(spec, "attn_pdrop"), output_copy=False),
        *dropout_saved("resid_dropout (attention)", plan, tokens * h, cb, resid),
        Saved("residual after attention (ln_2 input)", tokens * h * rb),
        *layer_norm_saved("ln_2", plan, tokens, h), *_cast(plan, tokens, h, 1, "c_fc"),
        Saved("c_fc output x (pow input)", tokens * i * cb), Saved("gelu_new 0.5*x", tokens * i * cb),
        Saved("gelu_new tanh output", tokens * i * cb), Saved("gelu_new 1+tanh", tokens * i * cb),
        Saved("gelu_new product (c_proj input)", tokens * i * cb),
        *dropout_saved("mlp dropout", plan, tokens * h, cb, resid),
    ]


def opt_layer_saved(spec: ModelSpec, plan: TrainingPlan, tokens: int, seq: int) -> list[Saved]:
    """`models/opt/modeling_opt.py: OPTDecoderLayer` (pre-LN): q_proj(x)*scaling, k, v saved by sdpa (its output is
    out_proj's input); `dropout` after out_proj and after fc2, `attention_dropout` on the probabilities; relu saves
    its output (fc2's input) only."""
    h, i = spec.hidden_size, spec.intermediate_size
    cb, rb = _bytes(plan)
    q = spec.num_heads * spec.head_dim
    p = _p(spec, "dropout")
    return [
        Saved("input (residual stream)", tokens * h * rb),
        *layer_norm_saved("self_attn_layer_norm", plan, tokens, h), *_cast(plan, tokens, h, 3, "q/k/v"),
        *attention_saved(spec, plan, tokens, seq, [Saved("q_proj * scaling", tokens * q * cb),
                                                   Saved("k_proj", tokens * q * cb), Saved("v_proj", tokens * q * cb)],
                         _p(spec, "attention_dropout"), output_copy=False),
        *dropout_saved("attention output", plan, tokens * h, cb, p),
        Saved("residual after attention", tokens * h * rb),
        *layer_norm_saved("final_layer_norm", plan, tokens, h), *_cast(plan, tokens, h, 1, "fc1"),
        Saved("relu(fc1) output", tokens * i * cb),
        *dropout_saved("fc2 output", plan, tokens * h, cb, p),
    ]


def neox_layer_saved(spec: ModelSpec, plan: TrainingPlan, tokens: int, seq: int) -> list[Saved]:
    """`models/gpt_neox/modeling_gpt_neox.py: GPTNeoXLayer` (parallel residual): with a fused sdpa kernel the
    query_key_value output stays alive (v is a view of it) with the partial rotary `cat(rotated, pass)` copies of q
    and k; the attention output's contiguous reshape is dense's input; hidden_dropout after dense and after the
    MLP, attention_dropout on the probabilities; gelu saves the h_to_4h output and dense_4h_to_h its output."""
    h, i = spec.hidden_size, spec.intermediate_size
    cb, rb = _bytes(plan)
    q = spec.num_heads * spec.head_dim
    hidden = _p(spec, "hidden_dropout")
    items = [
        Saved("input (residual stream)", tokens * h * rb),
        *layer_norm_saved("input_layernorm", plan, tokens, h), *_cast(plan, tokens, h, 1, "query_key_value"),
        *attention_saved(spec, plan, tokens, seq, [
            Saved("query_key_value output", tokens * 3 * q * cb),
            Saved("q rotary cat", tokens * q * cb), Saved("k rotary cat", tokens * q * cb)],
            _p(spec, "attention_dropout")),
        *dropout_saved("post_attention_dropout", plan, tokens * h, cb, hidden),
    ]
    if spec.options.get("use_parallel_residual") is False:
        items.append(Saved("residual after attention", tokens * h * rb))
    return items + [
        *layer_norm_saved("post_attention_layernorm", plan, tokens, h), *_cast(plan, tokens, h, 1, "dense_h_to_4h"),
        Saved("dense_h_to_4h output (gelu input)", tokens * i * cb), Saved("gelu output", tokens * i * cb),
        *dropout_saved("post_mlp_dropout", plan, tokens * h, cb, hidden),
    ]


def falcon_layer_saved(spec: ModelSpec, plan: TrainingPlan, tokens: int, seq: int) -> list[Saved]:
    """`models/falcon/modeling_falcon.py: FalconDecoderLayer` (parallel attention). Old architecture (multi-query):
    sdpa with an explicit mask runs the math path in both attention modes (q, k, v operands as in
    `_falcon_math_sdpa_operands`, fp32 probabilities); new architecture: RoPE q and k (k expanded to all heads), v,
    sdpa; eager as `attention_saved`. MLP: dense_h_to_4h output and gelu output. `dropout_add` applies
    hidden_dropout once per parallel layer (twice otherwise), attention_dropout on the probabilities.
    Checked in fp32 (real runs) and, old architecture, bf16 / bf16-mixed at full size (simulation); the
    non-parallel layout reuses these terms."""
    h, i = spec.hidden_size, spec.intermediate_size
    cb, rb = _bytes(plan)
    q, heads = spec.num_heads * spec.head_dim, spec.num_heads
    kv = spec.num_kv_heads * spec.head_dim
    new = bool(spec.options.get("new_decoder_architecture"))
    parallel = spec.options.get("parallel_attn", True)
    items = [Saved("input (residual stream)", tokens * h * rb)]
    items += layer_norm_saved("ln_attn" if new else "input_layernorm", plan, tokens, h)
    if new:
        items += layer_norm_saved("ln_mlp", plan, tokens, h)
    items += _cast(plan, tokens, h, 2, "query_key_value, dense_h_to_4h")
    if new:
        items += attention_saved(spec, plan, tokens, seq, [
            Saved("query (RoPE)", tokens * q * cb), Saved("key (RoPE)", tokens * q * cb),
            Saved("key expanded to all heads", tokens * q * cb), Saved("value", tokens * kv * cb)],
            _p(spec, "attention_dropout"), output_copy=False)
    else:
        math = plan.attn is Attention.SDPA
        items += [Saved("query_key_value split indices [-2], [-1] (int64)", 16),
                  *(_falcon_math_sdpa_operands if math else _falcon_eager_operands)(spec, plan, tokens),
                  # eager: softmax(dtype=hidden_states.dtype), the layernorm output's: fp32 under autocast
                  Saved("attention probabilities (softmax)", tokens * heads * seq * (FP32 if math else rb)),
                  Saved("attention output", tokens * q * cb)]
        if not math and plan.precision.is_mixed:  # autocast casts them to half for `@ value`, which keeps the cast
            items.append(Saved("attention probabilities cast to half (matmul operand)", tokens * heads * seq * cb))
    hidden = _p(spec, "hidden_dropout")
    if not parallel:
        items += [*dropout_saved("attention dropout_add", plan, tokens * h, cb, hidden),
                  Saved("residual after attention", tokens * h * rb),
                  *layer_norm_saved("post_attention_layernorm", plan, tokens, h)]
    return items + [Saved("dense_h_to_4h output (gelu input)", tokens * i * cb), Saved("gelu output", tokens * i * cb),
                    *dropout_saved("mlp dropout_add", plan, tokens * h, cb, hidden)]


def _falcon_math_sdpa_operands(spec: ModelSpec, plan: TrainingPlan, tokens: int) -> list[Saved]:
    """The q, k, v bmm operands `_scaled_dot_product_attention_math` saves for falcon's old architecture (k and v
    with num_kv_heads heads, no `enable_gqa`: `at::matmul` broadcasts them over the query heads). Half inputs are
    upcast to fp32 first (q*sqrt(scale), k*sqrt(scale), v.to(float32)); the broadcast k and v stay stride-0 views
    of their kv-head tensors when the micro-batch is 1 (the expanded batch and head dims merge into one bmm batch
    dim) and are copied to all heads otherwise. fp32 inputs: as measured, three query-sized operands."""
    cb, _ = _bytes(plan)
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    if cb == FP32:
        return [Saved("query scaled (math sdpa)", tokens * q * cb), Saved("key expanded, scaled", tokens * q * cb),
                Saved("value expanded", tokens * q * cb)]
    k_width = kv if plan.batch_size == 1 else q
    return [Saved("math sdpa q*sqrt(scale) (fp32)", tokens * q * FP32),
            Saved("math sdpa k*sqrt(scale) (fp32 bmm operand)", tokens * k_width * FP32),
            Saved("math sdpa v.to(float32) (bmm operand)", tokens * k_width * FP32)]


def _falcon_eager_operands(spec: ModelSpec, plan: TrainingPlan, tokens: int) -> list[Saved]:
    """`FalconAttention.forward`'s eager branch (old architecture, `--attn eager`): `query @ key.transpose(-1, -2)`
    and `softmax(...) @ value` in the compute dtype; `at::matmul` broadcasts k and v from their kv heads to the
    query heads, a stride-0 view at micro-batch 1 and a copy otherwise (as in `_falcon_math_sdpa_operands`); the
    scores are scaled in place and the mask added into a new tensor that softmax does not keep."""
    cb, _ = _bytes(plan)
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    k_width = kv if plan.batch_size == 1 else q
    return [Saved("query (RoPE, matmul operand)", tokens * q * cb),
            Saved("key (matmul operand)", tokens * k_width * cb),
            Saved("value (matmul operand)", tokens * k_width * cb)]


def falcon_math_attention(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """Falcon's old architecture with parallel attention under `--attn sdpa`: sdpa with an explicit mask runs the
    math path (`--attn eager` runs `FalconAttention`'s own matmul-softmax branch, `_falcon_eager_operands`)."""
    return (spec.model_type == "falcon" and plan.attn is Attention.SDPA
            and not spec.options.get("new_decoder_architecture")
            and bool(spec.options.get("parallel_attn", True)))


def attention_backward_freed_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Saved tensors of a falcon (math-path) layer already released when its softmax backward runs: the MLP's
    (dense_h_to_4h output, gelu output, and under autocast dense_h_to_4h's input cast) — the MLP ran last, so its
    backward runs first —, the attention output (saved by `dense`) and the v operand (released by the bmm
    backward)."""
    if not falcon_math_attention(spec, plan):
        return 0
    tokens = plan.batch_size * plan.seq_len
    cb, _ = _bytes(plan)
    i, q = spec.intermediate_size, spec.num_heads * spec.head_dim
    value = _falcon_math_sdpa_operands(spec, plan, tokens)[2].bytes
    mlp_cast = sum(s.bytes for s in _cast(plan, tokens, spec.hidden_size, 1, "dense_h_to_4h"))
    return 2 * tokens * i * cb + mlp_cast + tokens * q * cb + value


def attention_backward_transient_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Gradients alive in a falcon (math-path) layer when `_softmax_backward_data` allocates its output:
    that output and the probabilities' gradient from the `bmm` backward (fp32, batch × heads × seq² each, next to
    the saved probabilities), v's gradient (the bmm gradient summed over the broadcast heads, fp32 when upcast),
    the gradient of the layer output (held by the residual branch, param dtype) and the MLP branch's gradient of
    the layernorm output (residual-stream dtype), which waits for the attention branch's to be added to it."""
    if not falcon_math_attention(spec, plan):
        return 0
    tokens = plan.batch_size * plan.seq_len
    cb, rb = _bytes(plan)
    scores = tokens * spec.num_heads * plan.seq_len
    kv = spec.num_kv_heads * spec.head_dim
    v_grad = tokens * kv * (cb if cb == FP32 else FP32)
    return (2 * scores * FP32 + v_grad + tokens * spec.hidden_size * plan.precision.param_bytes
            + tokens * spec.hidden_size * rb)


def bloom_layer_saved(spec: ModelSpec, plan: TrainingPlan, tokens: int, seq: int) -> list[Saved]:
    """`models/bloom/modeling_bloom.py: BloomBlock` (eager only): fused query_key_value split into q, k, v copies
    (baddbmm / bmm operands), alibi `baddbmm` scores → fp32 softmax (cast back when half), context (dense input);
    hidden_dropout in both `dropout_add`s, attention_dropout on the probabilities; bloom_gelu_forward saves x and
    its output (4h MLP)."""
    h, i = spec.hidden_size, 4 * spec.hidden_size
    cb, rb = _bytes(plan)
    hidden = _p(spec, "hidden_dropout")
    return [
        Saved("input (residual stream)", tokens * h * rb),
        *layer_norm_saved("input_layernorm", plan, tokens, h), *_cast(plan, tokens, h, 1, "query_key_value"),
        *attention_saved(spec, plan.with_(attn="eager"), tokens, seq, [], _p(spec, "attention_dropout")),
        *dropout_saved("attention dropout_add", plan, tokens * h, cb, hidden),
        Saved("residual after attention", tokens * h * rb),
        *layer_norm_saved("post_attention_layernorm", plan, tokens, h), *_cast(plan, tokens, h, 1, "dense_h_to_4h"),
        Saved("dense_h_to_4h output", tokens * i * cb), Saved("bloom_gelu output", tokens * i * cb),
        *dropout_saved("mlp dropout_add", plan, tokens * h, cb, hidden),
    ]


def moe_routing_weight_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Element size of the routing weights the experts receive: `MixtralTopKRouter` returns the fp32 topk of its
    fp32 softmax; `Qwen2MoeTopKRouter` casts them back to the router logits' dtype (the compute dtype)."""
    return FP32 if spec.model_type == "mixtral" else plan.precision.compute_bytes


def moe_saved(spec: ModelSpec, plan: TrainingPlan, tokens: int) -> list[Saved]:
    """transformers 5 `MixtralSparseMoeBlock` / `Qwen2MoeSparseMoeBlock` with grouped experts: router softmax
    (fp32), top-k indices, routing weights, tokens sorted by expert and gathered (tokens × top_k rows), grouped
    gate_up output, silu, silu*up, down output (scaled by the routing weights), offsets and permutations.
    The experts compute in their weights' dtype, not autocast's: `integrations/moe.py: _grouped_mm` runs
    `grouped_mm(input.to(weight.dtype), weight)` (grouped mm is not autocast-enabled), so under mixed precision
    the gathered tokens (the fp32 layernorm output) and every expert tensor are fp32."""
    h, e, k = spec.hidden_size, spec.num_experts, spec.experts_per_token
    i = spec.moe_intermediate_size or spec.intermediate_size
    _, rb = _bytes(plan)
    cb = plan.precision.param_bytes  # the expert weights' dtype
    r = tokens * k
    items = [Saved("router softmax", tokens * e * FP32), Saved("topk indices", r * 8)]
    if spec.model_type == "mixtral" or spec.options.get("norm_topk_prob"):
        items += [Saved("topk weight sum", tokens * FP32), Saved("normalized routing weights", r * FP32)]
    return items + [
        Saved("sorted expert ids", r * 8), Saved("sort permutation", r * 8),
        Saved("gathered tokens (tokens × top_k)", r * h * rb),
        Saved("gathered routing weights", r * moe_routing_weight_bytes(spec, plan)),
        Saved("expert offsets (cumsum)", e * FP32), Saved("grouped gate_up output", r * 2 * i * cb),
        Saved("silu(gate)", r * i * cb), Saved("silu(gate) * up", r * i * cb),
        Saved("grouped down_proj output", r * h * cb), Saved("inverse permutation", r * 8),
    ]


def llama_family_saved(spec: ModelSpec, plan: TrainingPlan, tokens: int, seq: int) -> list[Saved]:
    """llama with the per-family differences of the llama-like decoders:
    phi3 `Phi3Attention`/`Phi3MLP`: fused qkv_proj (kept alive by the v view) and gate_up_proj (chunk views);
    qwen3 `Qwen3RMSNorm` q_norm/k_norm on (tokens, heads, head_dim) before RoPE;
    gemma `GemmaRMSNorm`: x.float() normalized * (1 + weight.float()) saves the fp32 (1+w) (h*4 per norm);
    mixtral/qwen2_moe: the MLP is replaced by `moe_saved` (+ qwen2_moe's shared expert and its sigmoid gate)."""
    items = llama_layer_saved(spec, plan, tokens, seq)
    cb, rb = _bytes(plan)
    mt = spec.model_type
    q = spec.num_heads * spec.head_dim // plan.tp
    kv = spec.num_kv_heads * spec.head_dim // plan.tp
    i = spec.intermediate_size // plan.tp
    h = spec.hidden_size
    if mt in ("gemma", "gemma2"):
        # GemmaRMSNorm keeps its normalized product in fp32 (`output * (1 + weight.float())`, cast after)
        items = [Saved(s.name, tokens * h * FP32) if s.name.endswith(".normalized") else s for s in items]
        norms = ["input_layernorm", "post_attention_layernorm"]
        if mt == "gemma2":
            # Gemma2DecoderLayer: post_attention_layernorm on the o_proj output and post_feedforward_layernorm on the
            # MLP output (their outputs go to the residual add, unsaved); x.float() (the fp32 input, a copy when
            # half) saved by pow/mul, rsqrt, fp32 normalized. The llama pre-MLP norm above is pre_feedforward.
            for n, what in (("post_attention_layernorm", "o_proj output"),
                            ("post_feedforward_layernorm", "mlp output")):
                items += [Saved(f"{n} input ({what}, fp32)", tokens * h * FP32), Saved(f"{n}.rsqrt", tokens * FP32),
                          Saved(f"{n}.normalized", tokens * h * FP32)]
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        items += [Saved(f"{n}.(1+weight) fp32", h * FP32) for n in norms]
    if mt == "qwen3":
        # Qwen3RMSNorm on the q/k projection (cb): `x.to(float32)` (a copy unless fp32) saved by pow and by the
        # mul with rsqrt; `.normalized` = `(x * rsqrt).to(input_dtype)` (cb, a copy unless fp32) saved by
        # `weight * x`. The norm's output goes to RoPE, whose muls by cos/sin (no grad) do not save it.
        for name, width, n in (("q_norm", q, spec.num_heads // plan.tp), ("k_norm", kv, spec.num_kv_heads // plan.tp)):
            items += [Saved(f"{name}.rsqrt", tokens * n * FP32), Saved(f"{name}.input in fp32", tokens * width * FP32),
                      Saved(f"{name}.normalized", tokens * width * cb)]
    if mt == "phi3":
        items = [s for s in items if s.name not in ("v_proj", "gate_proj", "up_proj", "autocast input casts q/k/v",
                                                     "autocast input casts gate/up")]
        if _flash(spec, plan):  # sdpa saves v as a view of the fused output; the output's transpose is not contiguous
            items += [Saved("qkv_proj output (v view kept)", tokens * (q + 2 * kv) * cb),
                      Saved("attention output contiguous (o_proj input)", tokens * q * cb)]
        items += [Saved("gate_up_proj output", tokens * 2 * i * cb)]
        items += _cast(plan, tokens, spec.hidden_size, 2, "qkv_proj, gate_up_proj")
        for n in ("resid_attn_dropout", "resid_mlp_dropout"):
            items += dropout_saved(n, plan, tokens * h, cb, _p(spec, "resid_pdrop"))
    if mt in ("mixtral", "qwen2_moe"):
        mlp = ("gate_proj", "silu(gate)", "up_proj", "silu(gate) * up", "autocast input casts gate/up")
        items = [s for s in items if s.name not in mlp]
        items += moe_saved(spec, plan, tokens)
        if mt == "qwen2_moe" and spec.shared_expert_intermediate_size:
            si = spec.shared_expert_intermediate_size
            items += _cast(plan, tokens, spec.hidden_size, 3, "shared gate/up, shared_expert_gate")
            items += [Saved(f"shared_expert {n}", tokens * si * cb)
                      for n in ("gate_proj", "silu(gate)", "up_proj", "silu(gate) * up")]
            items += [Saved("shared_expert output", tokens * spec.hidden_size * cb),
                      Saved("shared_expert_gate sigmoid", tokens * cb)]
        elif plan.precision.is_mixed:
            items += _cast(plan, tokens, spec.hidden_size, 1, "router")
    return items


_TABLES = {"gpt2": gpt2_layer_saved, "opt": opt_layer_saved, "gpt_neox": neox_layer_saved,
           "falcon": falcon_layer_saved, "bloom": bloom_layer_saved}


def layer_saved(spec: ModelSpec, plan: TrainingPlan) -> tuple[Saved, ...]:
    """One decoder layer's saved tensors (its family's table). The walks ask for it many times per estimate, so it
    is kept per spec and plan (both immutable)."""
    cache = spec.__dict__.setdefault("_layer_saved", {})
    if plan not in cache:
        table = _TABLES.get(spec.model_type, llama_family_saved)
        cache[plan] = tuple(table(spec, plan, plan.batch_size * plan.seq_len, plan.seq_len))
    return cache[plan]


def layer_activation_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Bytes one decoder layer keeps for backward without checkpointing."""
    return sum(s.bytes for s in layer_saved(spec, plan))


def checkpointed_layer_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """With checkpointing (`use_reentrant=False`), a layer keeps only its input hidden states."""
    _, rb = _bytes(plan)
    return plan.batch_size * plan.seq_len * spec.hidden_size * rb


def checkpointed_input_extra_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Full checkpointing: the checkpoint keeps the layer's input (tokens × h × rb), alive through the layer's
    recompute and backward. `layer_saved` lists it where an op of the layer saves it too (the fp32 residual stream,
    a LayerNorm's input); in pure half precision an RMSNorm saves its fp32 copy instead, so the input is extra."""
    if plan.grad_ckpt is not GradCkpt.FULL:
        return 0
    if any(s.name.startswith("input (residual stream") for s in layer_saved(spec, plan)):
        return 0
    return checkpointed_layer_bytes(spec, plan)


# `torch.get_rng_state()`: the CPU generator's state as a uint8 tensor (mt19937 state + normal-sampling cache).
CPU_RNG_STATE_BYTES = 5056


def checkpoint_rng_state_bytes(plan: TrainingPlan) -> int:
    """`torch.utils.checkpoint` (`use_reentrant=False`, `preserve_rng_state=True`, the default) stashes
    `fwd_cpu_state = torch.get_rng_state()` at each checkpointed layer's forward, kept by the checkpoint frame until
    the layer's backward has run. It is a CPU tensor on every device (the CUDA generators' states it also saves are
    CPU tensors too), so only the cpu profile counts it. The recompute stashes another copy whose release is not
    tied to the layer's backward; it is not modelled."""
    return CPU_RNG_STATE_BYTES if plan.grad_ckpt is GradCkpt.FULL and plan.device is Device.CPU else 0


# The dropout on the MLP's output, the layer's last op before the residual add (gpt2 `resid_pdrop`, OPT `dropout`
# after fc2, phi3 `resid_mlp_dropout`, bloom/falcon `dropout_add`).
_MLP_OUTPUT_DROPOUTS = ("mlp dropout", "fc2 output dropout", "resid_mlp_dropout", "post_mlp_dropout",
                        "mlp dropout_add")


def mlp_output_dropout_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """What the dropout on the MLP output saved (CPU: its noise; CUDA: its bool mask). Its backward is the first
    node of the layer's backward, and autograd releases a node's saved tensors once it ran, so this is gone before
    the layer's backward reaches its MLP peak (the `backward (layer ...)` moments)."""
    return sum(s.bytes for s in layer_saved(spec, plan) if s.name.startswith(_MLP_OUTPUT_DROPOUTS))


def kept_per_layer_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    if plan.grad_ckpt is GradCkpt.FULL:
        return checkpointed_layer_bytes(spec, plan) + checkpoint_rng_state_bytes(plan)
    return layer_activation_bytes(spec, plan)


def layer_plan(plan: TrainingPlan, layer: int) -> TrainingPlan:
    """The plan as decoder layer `layer` sees it: `--ckpt-every K` checkpoints the layers with index % K == 0; the
    others run exactly as without checkpointing (same saved tensors, same backward), so their terms are those of
    the plan with `--grad-ckpt none`."""
    if plan.grad_ckpt is not GradCkpt.FULL or plan.ckpt_every == 1:
        return plan
    return plan if plan.checkpointed(layer) else _uncheckpointed(plan)


@lru_cache(maxsize=64)
def _uncheckpointed(plan: TrainingPlan) -> TrainingPlan:
    return plan.with_(grad_ckpt=GradCkpt.NONE, ckpt_every=1)


def checkpointed_layer_count(spec: ModelSpec, plan: TrainingPlan) -> int:
    """How many decoder layers are checkpointed (and recomputed in backward): ceil(L / K) with --grad-ckpt full."""
    if plan.grad_ckpt is not GradCkpt.FULL:
        return 0
    return -(-spec.num_layers // plan.ckpt_every)


def kept_layers_bytes(spec: ModelSpec, plan: TrainingPlan, count: int) -> int:
    """What decoder layers 0 .. count-1 keep from forward to backward: a checkpointed layer its input
    (`checkpointed_layer_bytes`), any other its full `layer_activation_bytes`. With --ckpt-every K > 1, layer l's
    input is the previous layer's residual-add output, which that layer does not save itself, so the two kinds
    add up without overlap."""
    if plan.ckpt_every == 1 or plan.grad_ckpt is not GradCkpt.FULL:
        return count * kept_per_layer_bytes(spec, plan)
    ckpt = -(-count // plan.ckpt_every)  # layers 0, K, 2K, ... below `count`
    full = layer_activation_bytes(spec, layer_plan(plan, 1))
    return ckpt * (checkpointed_layer_bytes(spec, plan) + checkpoint_rng_state_bytes(plan)) + (count - ckpt) * full


def current_layer_backward_bytes(spec: ModelSpec, plan: TrainingPlan, layer: int) -> int:
    """What layer `layer` holds while its own backward runs: checkpointed, its input plus everything the recompute
    saves again (`layer_activation_bytes` + `checkpointed_input_extra_bytes`) and its forward RNG state
    (`checkpoint_rng_state_bytes`); otherwise its saved tensors."""
    lp = layer_plan(plan, layer)
    if lp.grad_ckpt is GradCkpt.FULL:
        return recompute_bytes(spec, lp)
    return layer_activation_bytes(spec, lp)


def recompute_bytes(spec: ModelSpec, plan: TrainingPlan, saved: int | None = None) -> int:
    """A checkpointed layer during its backward: what its recompute saved (`saved`, default the layer's
    `layer_activation_bytes` + `checkpointed_input_extra_bytes`) and its forward RNG state, still held."""
    if saved is None:
        saved = layer_activation_bytes(spec, plan) + checkpointed_input_extra_bytes(spec, plan)
    return saved + checkpoint_rng_state_bytes(plan)


def backward_layers(spec: ModelSpec, plan: TrainingPlan, edge: int = 1) -> list[int]:
    """Decoder layers whose backward the walk evaluates, last first. With identical layers the live total is linear
    in the layer index between the `edge` outermost layers at each end, so those suffice.

    With --ckpt-every K > 1 the pattern of kept bytes and gradients repeats every K layers, so the K (+ edge - 1)
    layers at each end hold the extremes (every residue class mod K has its first and last layer there). Inside
    those two spans the total is also linear along each run of consecutive layers that are neither checkpointed
    nor among the `edge` outermost (a layer of such a run keeps one more uncheckpointed layer below it than its
    predecessor, and its gradients one layer fewer above; everything else is the same): a run's largest value,
    and the first of equal ones in the walk's last-first order, is at one of its two ends. So only the run ends
    are evaluated, next to the checkpointed and outermost layers — O(1) layers per plan instead of 2K, the same
    peak and peak phase (tests/test_ckpt_walk.py compares with the full spans)."""
    n = spec.num_layers
    if plan.grad_ckpt is not GradCkpt.FULL or plan.ckpt_every == 1:
        return sorted({*range(min(edge, n)), *range(max(n - edge, 0), n)}, reverse=True)
    k = plan.ckpt_every
    span = k + edge - 1
    low, high = min(span, n), max(n - span, 0)  # the spans: [0, low) and [high, n)

    def inside(layer: int) -> bool:
        return 0 <= layer < low or high <= layer < n

    def breaks(layer: int) -> bool:  # a layer that ends a linear run (or lies outside the spans)
        return not inside(layer) or layer < edge or layer >= n - edge or layer % k == 0

    # the layers next to a break: the outermost, the checkpointed ones in the spans, the spans' own ends
    near = {*range(edge + 1), *range(n - edge - 1, n), low - 1, low, high - 1, high,
            *range(0, low, k), *range(-(-high // k) * k, n, k)}
    near |= {x + d for x in near for d in (-1, 1)}
    return sorted((x for x in near if inside(x) and (breaks(x) or breaks(x - 1) or breaks(x + 1))), reverse=True)


def final_norm_saved(spec: ModelSpec, plan: TrainingPlan) -> list[Saved]:
    """The final norm and what the lm_head saves of its input: the last layer's output (saved by the norm: LayerNorm
    always, RMSNorm when fp32 — under pure half its fp32 copy is in `rms_norm_saved`), the norm's statistics, and the
    lm_head's input (the norm output, or its autocast cast to half under mixed precision: tokens*h*cb either way).
    OPT with word_embed_proj_dim != hidden: project_out saves the norm output and the lm_head its output."""
    tokens = plan.batch_size * plan.seq_len
    h = spec.hidden_size
    cb, rb = _bytes(plan)
    layer = spec.family.norm == "layer"
    items = []
    if rb == 4 or layer:
        items.append(Saved("last layer output (final norm input)", tokens * h * rb))
    if layer:
        items += [Saved("final norm.mean", tokens * FP32), Saved("final norm.rstd", tokens * FP32)]
    else:
        items += rms_norm_saved("final norm", spec, plan, tokens, output_saved=False)
        if spec.model_type in ("gemma", "gemma2"):
            items = [Saved(s.name, tokens * h * FP32) if s.name.endswith(".normalized") else s for s in items]
            items.append(Saved("final norm.(1+weight) fp32", h * FP32))
    items.append(Saved("lm_head input (final norm output or its autocast cast)", tokens * h * cb))
    proj = _proj_dim(spec)
    if spec.model_type == "opt" and proj != h:
        items.append(Saved("project_out output (lm_head input)", tokens * proj * cb))
    return items


def final_norm_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    return sum(s.bytes for s in final_norm_saved(spec, plan))


ROPE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "mixtral", "qwen2_moe", "gpt_neox",
                 "falcon")


def outer_saved(spec: ModelSpec, plan: TrainingPlan) -> list[Saved]:
    """Outside the decoder layers, before them (alive until the embedding's backward):
    the step's input_ids (also the labels; allocated before the peak reset, int64);
    RoPE cos and sin (`*RotaryEmbedding`, position_ids of batch 1: seq × rotary dim, in the hidden states' dtype;
    gpt_neox rotates rotary_pct of head_dim);
    gpt2: wpe's position ids (1 × seq int64) and embd_pdrop's dropout; opt: position ids (batch × seq int64) and
    project_in's input when word_embed_proj_dim != hidden; gpt_neox: emb_dropout (hidden_dropout); phi3: embd_pdrop;
    bloom: word_embeddings_layernorm's input (the embedding output), mean and rstd; gemma: the √h normalizer tensor.
    The embeddings' output that enters layer 0 is that layer's input (`layer_saved`)."""
    _, rb = _bytes(plan)
    cb, _ = _bytes(plan)
    tokens, seq, h = plan.batch_size * plan.seq_len, plan.seq_len, spec.hidden_size
    mt = spec.model_type
    items = [Saved("input_ids (labels)", tokens * 8)]
    if mt in ROPE_FAMILIES:
        rot = spec.head_dim
        if mt == "gpt_neox":
            rot = int(spec.head_dim * (_p(spec, "rotary_pct") if spec.options.get("rotary_pct") is not None else 1))
        items.append(Saved("RoPE cos, sin", 2 * seq * rot * rb))
    if mt == "gpt2":
        items += [Saved("wpe position ids", seq * 8), *dropout_saved("embd_pdrop", plan, tokens * h, rb,
                                                                      _p(spec, "embd_pdrop"))]
    if mt == "opt":
        items.append(Saved("embed_positions position ids", tokens * 8))
        proj = _proj_dim(spec)
        if proj != h:
            items.append(Saved("project_in input (embeddings)", tokens * proj * cb))
    if mt == "gpt_neox":
        items += dropout_saved("emb_dropout", plan, tokens * h, rb, _p(spec, "hidden_dropout"))
    if mt == "phi3":
        items += dropout_saved("embd_dropout", plan, tokens * h, rb, _p(spec, "embd_pdrop"))
    if mt == "bloom":
        items += [Saved("word_embeddings_layernorm input", tokens * h * rb),
                  Saved("word_embeddings_layernorm.mean", tokens * FP32),
                  Saved("word_embeddings_layernorm.rstd", tokens * FP32)]
    if mt in ("gemma", "gemma2"):
        items.append(Saved("embedding normalizer (scalar)", rb))
    items += checkpoint_held_saved(spec, plan)
    return items


# Llama-like decoders whose model forward makes `position_ids = cache_position.unsqueeze(0)` and passes it to every
# decoder layer (transformers 5.23 `LlamaModel.forward` and the families built on it).
POSITION_ID_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "mixtral", "qwen2_moe")


def checkpoint_held_saved(spec: ModelSpec, plan: TrainingPlan) -> list[Saved]:
    """What a checkpointed decoder layer keeps alive beyond its saved tensors: `torch.utils.checkpoint`
    (`use_reentrant=False`) keeps the layer call's arguments for the recompute (`recompute_fn` closes over
    `args`/`kwargs`), so the model forward's `position_ids` (1 × seq int64, `cache_position.unsqueeze(0)`; without
    checkpointing only RoPE's cos/sin derived from it survive the forward) lives until layer 0's backward — the
    first checkpointed layer. gpt2/opt save their position ids anyway (`outer_saved`)."""
    if plan.grad_ckpt is not GradCkpt.FULL or spec.model_type not in POSITION_ID_FAMILIES:
        return []
    return [Saved("position_ids (held by the checkpointed layers' inputs)", plan.seq_len * 8)]


def outer_saved_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    return sum(s.bytes for s in outer_saved(spec, plan))
