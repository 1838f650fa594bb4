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

from llmem.plan import Attention, GradCkpt, Precision, TrainingPlan
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
    heads = spec.num_heads // tp
    i = spec.intermediate_size // tp
    cb, rb = _bytes(plan)
    mixed = plan.precision.is_mixed
    items: list[Saved] = []
    if rb == 4:
        items.append(Saved("input (residual stream)", tokens * h * rb))
    items += rms_norm_saved("input_layernorm", spec, plan, tokens, output_saved=not mixed)
    if mixed:
        items.append(Saved("autocast input casts q/k/v", 3 * tokens * h * 2))
    items += [
        Saved("q_embed (RoPE)", tokens * q * cb),
        Saved("k_embed (RoPE)", tokens * kv * cb),
        Saved("v_proj", tokens * kv * cb),
    ]
    if plan.attn is Attention.SDPA:
        items += [Saved("sdpa output", tokens * q * cb), Saved("sdpa logsumexp", tokens * heads * FP32)]
    else:
        groups = spec.num_heads // spec.num_kv_heads
        if groups > 1:
            items.append(Saved("repeat_kv k, v", 2 * tokens * q * cb))
        items += [
            Saved("attention scores (fp32 softmax input)", tokens * heads * seq * FP32),
            Saved("attention probabilities", tokens * heads * seq * cb),
            Saved("attention output", tokens * q * cb),
        ]
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


def _sdpa(spec: ModelSpec, plan: TrainingPlan, tokens: int, seq: int) -> list[Saved]:
    cb, _ = _bytes(plan)
    q, heads = spec.num_heads * spec.head_dim // plan.tp, spec.num_heads // plan.tp
    if plan.attn is Attention.SDPA:
        return [Saved("sdpa output", tokens * q * cb), Saved("sdpa logsumexp", tokens * heads * FP32)]
    return [Saved("attention scores (fp32 softmax input)", tokens * heads * seq * FP32),
            Saved("attention probabilities", tokens * heads * seq * cb), Saved("attention output", tokens * q * cb)]


def gpt2_layer_saved(spec: ModelSpec, plan: TrainingPlan, tokens: int, seq: int) -> list[Saved]:
    """`models/gpt2/modeling_gpt2.py: GPT2Block` (dropout off). Conv1D is `addmm(bias, x, W)`: c_attn's (tokens, 3h)
    output stays alive through the q/k/v views sdpa saves. GPT2MLP's gelu_new
    0.5*x*(1+tanh(c*(x+0.044715*x^3))) saves x, 0.5*x, tanh, 1+tanh, and the product (c_proj's input): 5 × inner."""
    h, i = spec.hidden_size, spec.intermediate_size
    cb, rb = _bytes(plan)
    q = spec.num_heads * spec.head_dim
    return [
        Saved("input (residual stream, ln_1 input)", tokens * h * rb),
        *layer_norm_saved("ln_1", plan, tokens, h), *_cast(plan, tokens, h, 1, "c_attn"),
        Saved("c_attn output (q, k, v views)", tokens * 3 * q * cb), *_sdpa(spec, plan, tokens, seq),
        Saved("residual after attention (ln_2 input)", tokens * h * rb),
        *layer_norm_saved("ln_2", plan, tokens, h), *_cast(plan, tokens, h, 1, "c_fc"),
        Saved("c_fc output x (pow input)", tokens * i * cb), Saved("gelu_new 0.5*x", tokens * i * cb),
        Saved("gelu_new tanh output", tokens * i * cb), Saved("gelu_new 1+tanh", tokens * i * cb),
        Saved("gelu_new product (c_proj input)", tokens * i * cb),
    ]


def opt_layer_saved(spec: ModelSpec, plan: TrainingPlan, tokens: int, seq: int) -> list[Saved]:
    """`models/opt/modeling_opt.py: OPTDecoderLayer` (pre-LN, dropout off): q_proj(x)*scaling, k, v; relu saves
    its output (fc2's input) only."""
    h, i = spec.hidden_size, spec.intermediate_size
    cb, rb = _bytes(plan)
    q = spec.num_heads * spec.head_dim
    return [
        Saved("input (residual stream)", tokens * h * rb),
        *layer_norm_saved("self_attn_layer_norm", plan, tokens, h), *_cast(plan, tokens, h, 3, "q/k/v"),
        Saved("q_proj * scaling", tokens * q * cb), Saved("k_proj", tokens * q * cb), Saved("v_proj", tokens * q * cb),
        *_sdpa(spec, plan, tokens, seq),
        Saved("residual after attention", tokens * h * rb),
        *layer_norm_saved("final_layer_norm", plan, tokens, h), *_cast(plan, tokens, h, 1, "fc1"),
        Saved("relu(fc1) output", tokens * i * cb),
    ]


def neox_layer_saved(spec: ModelSpec, plan: TrainingPlan, tokens: int, seq: int) -> list[Saved]:
    """`models/gpt_neox/modeling_gpt_neox.py: GPTNeoXLayer` (parallel residual): fused query_key_value output
    (v is a view of it), partial rotary `cat(rotated, pass)` copies of q and k, the attention output's contiguous
    reshape (dense's input), gelu saves the h_to_4h output and dense_4h_to_h its output."""
    h, i = spec.hidden_size, spec.intermediate_size
    cb, rb = _bytes(plan)
    q = spec.num_heads * spec.head_dim
    items = [
        Saved("input (residual stream)", tokens * h * rb),
        *layer_norm_saved("input_layernorm", plan, tokens, h), *_cast(plan, tokens, h, 1, "query_key_value"),
        Saved("query_key_value output", tokens * 3 * q * cb),
        Saved("q rotary cat", tokens * q * cb), Saved("k rotary cat", tokens * q * cb),
        *_sdpa(spec, plan, tokens, seq), Saved("attention output reshape (dense input)", tokens * q * cb),
    ]
    if spec.options.get("use_parallel_residual") is False:
        items.append(Saved("residual after attention", tokens * h * rb))
    return items + [
        *layer_norm_saved("post_attention_layernorm", plan, tokens, h), *_cast(plan, tokens, h, 1, "dense_h_to_4h"),
        Saved("dense_h_to_4h output (gelu input)", tokens * i * cb), Saved("gelu output", tokens * i * cb),
    ]


def falcon_layer_saved(spec: ModelSpec, plan: TrainingPlan, tokens: int, seq: int) -> list[Saved]:
    """`models/falcon/modeling_falcon.py: FalconDecoderLayer` (parallel attention). Old architecture (multi-query):
    attention runs the math path (q, k scaled, k/v expanded to all heads, fp32 probabilities); new architecture:
    RoPE q and k (k expanded to all heads), v, sdpa. MLP: dense_h_to_4h output and gelu output.
    Approximate: measured in fp32/sdpa only; eager and the non-parallel layout reuse these terms."""
    h, i = spec.hidden_size, spec.intermediate_size
    cb, rb = _bytes(plan)
    q, heads = spec.num_heads * spec.head_dim, spec.num_heads
    kv = spec.num_kv_heads * spec.head_dim
    new = bool(spec.options.get("new_decoder_architecture"))
    items = [Saved("input (residual stream)", tokens * h * rb)]
    items += layer_norm_saved("ln_attn" if new else "input_layernorm", plan, tokens, h)
    if new:
        items += layer_norm_saved("ln_mlp", plan, tokens, h)
    items += _cast(plan, tokens, h, 2, "query_key_value, dense_h_to_4h")
    if new:
        items += [Saved("query (RoPE)", tokens * q * cb), Saved("key (RoPE)", tokens * q * cb),
                  Saved("key expanded to all heads", tokens * q * cb), Saved("value", tokens * kv * cb),
                  *_sdpa(spec, plan, tokens, seq)]
    else:
        items += [Saved("query scaled (math sdpa)", tokens * q * cb), Saved("key expanded, scaled", tokens * q * cb),
                  Saved("attention probabilities (softmax)", tokens * heads * seq * FP32),
                  Saved("value expanded", tokens * q * cb), Saved("attention output", tokens * q * cb)]
    if not spec.options.get("parallel_attn", True):
        items += [Saved("residual after attention", tokens * h * rb),
                  *layer_norm_saved("post_attention_layernorm", plan, tokens, h)]
    return items + [Saved("dense_h_to_4h output (gelu input)", tokens * i * cb), Saved("gelu output", tokens * i * cb)]


def bloom_layer_saved(spec: ModelSpec, plan: TrainingPlan, tokens: int, seq: int) -> list[Saved]:
    """`models/bloom/modeling_bloom.py: BloomBlock` (eager only): fused query_key_value split into q, k, v copies,
    alibi `baddbmm` scores → fp32 softmax, context; bloom_gelu_forward saves x and its output (4h MLP).
    Approximate: measured in fp32 only."""
    h, i = spec.hidden_size, 4 * spec.hidden_size
    cb, rb = _bytes(plan)
    heads = spec.num_heads
    return [
        Saved("input (residual stream)", tokens * h * rb),
        *layer_norm_saved("input_layernorm", plan, tokens, h), *_cast(plan, tokens, h, 1, "query_key_value"),
        Saved("query", tokens * h * cb), Saved("key", tokens * h * cb), Saved("value", tokens * h * cb),
        Saved("alibi baddbmm scores softmax", tokens * heads * seq * FP32), Saved("context", tokens * h * cb),
        Saved("residual after attention", tokens * h * rb),
        *layer_norm_saved("post_attention_layernorm", plan, tokens, h), *_cast(plan, tokens, h, 1, "dense_h_to_4h"),
        Saved("dense_h_to_4h output", tokens * i * cb), Saved("bloom_gelu output", tokens * i * cb),
    ]


def moe_saved(spec: ModelSpec, plan: TrainingPlan, tokens: int) -> list[Saved]:
    """transformers 5 `MixtralSparseMoeBlock` / `Qwen2MoeSparseMoeBlock` with grouped experts: router softmax
    (fp32), top-k indices, routing weights, tokens sorted by expert and gathered (tokens × top_k rows), grouped
    gate_up output, silu, silu*up, down output (scaled by the routing weights), offsets and permutations."""
    h, e, k = spec.hidden_size, spec.num_experts, spec.experts_per_token
    i = spec.moe_intermediate_size or spec.intermediate_size
    cb, _ = _bytes(plan)
    r = tokens * k
    items = [Saved("router softmax", tokens * e * FP32), Saved("topk indices", r * 8)]
    if spec.model_type == "mixtral" or spec.options.get("norm_topk_prob"):
        items += [Saved("topk weight sum", tokens * FP32), Saved("normalized routing weights", r * FP32)]
    return items + [
        Saved("sorted expert ids", r * 8), Saved("sort permutation", r * 8),
        Saved("gathered tokens (tokens × top_k)", r * h * cb), Saved("gathered routing weights", r * FP32),
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
    if mt in ("gemma", "gemma2"):
        items += [Saved(f"{n}.(1+weight) fp32", spec.hidden_size * FP32)
                  for n in ("input_layernorm", "post_attention_layernorm")]
    if mt == "qwen3":
        for name, width, n in (("q_norm", q, spec.num_heads // plan.tp), ("k_norm", kv, spec.num_kv_heads // plan.tp)):
            items += [Saved(f"{name}.rsqrt", tokens * n * FP32), Saved(f"{name}.normalized", tokens * width * rb),
                      Saved(f"{name}.output", tokens * width * cb)]
    if mt == "phi3":
        items = [s for s in items if s.name not in ("v_proj", "gate_proj", "up_proj", "autocast input casts q/k/v",
                                                     "autocast input casts gate/up")]
        items += [Saved("qkv_proj output (v view kept)", tokens * (q + 2 * kv) * cb),
                  Saved("gate_up_proj output", tokens * 2 * i * cb)]
        items += _cast(plan, tokens, spec.hidden_size, 2, "qkv_proj, gate_up_proj")
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
                      Saved("shared_expert_gate sigmoid", tokens * FP32)]
        elif plan.precision.is_mixed:
            items += _cast(plan, tokens, spec.hidden_size, 1, "router")
    return items


_TABLES = {"gpt2": gpt2_layer_saved, "opt": opt_layer_saved, "gpt_neox": neox_layer_saved,
           "falcon": falcon_layer_saved, "bloom": bloom_layer_saved}


def layer_saved(spec: ModelSpec, plan: TrainingPlan) -> list[Saved]:
    tokens = plan.batch_size * plan.seq_len
    table = _TABLES.get(spec.model_type, llama_family_saved)
    return table(spec, plan, tokens, plan.seq_len)


def layer_activation_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Bytes one decoder layer keeps for backward without checkpointing."""
    return sum(s.bytes for s in layer_saved(spec, plan))


def checkpointed_layer_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """With checkpointing (`use_reentrant=False`), a layer keeps only its input hidden states."""
    _, rb = _bytes(plan)
    return plan.batch_size * plan.seq_len * spec.hidden_size * rb


def kept_per_layer_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    if plan.grad_ckpt is GradCkpt.FULL:
        return checkpointed_layer_bytes(spec, plan)
    return layer_activation_bytes(spec, plan)


def final_norm_saved(spec: ModelSpec, plan: TrainingPlan) -> list[Saved]:
    tokens = plan.batch_size * plan.seq_len
    _, rb = _bytes(plan)
    items = []
    if rb == 4:
        items.append(Saved("last layer output", tokens * spec.hidden_size * rb))
    return items + rms_norm_saved("final norm", spec, plan, tokens, output_saved=not plan.precision.is_mixed)


def final_norm_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    return sum(s.bytes for s in final_norm_saved(spec, plan))


def outer_saved_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Outside the layers: RoPE cos and sin (`LlamaRotaryEmbedding`, cast to the hidden states' dtype, one row per
    token) and the int64 position ids (1 × seq)."""
    _, rb = _bytes(plan)
    tokens = plan.batch_size * plan.seq_len
    return 2 * tokens * spec.head_dim * rb + plan.seq_len * 8
