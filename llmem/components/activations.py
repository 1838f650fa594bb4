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


def layer_saved(spec: ModelSpec, plan: TrainingPlan) -> list[Saved]:
    tokens = plan.batch_size * plan.seq_len
    return llama_layer_saved(spec, plan, tokens, plan.seq_len)


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
