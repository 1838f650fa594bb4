"""The attention's backward from its sdpa core on: the core's own backward, q's RoPE backward, q_norm's backward.

sdpa's backward (`_scaled_dot_product_*_backward`) allocates q's, k's and v's gradients (compute dtype) while its
saved q, k, v, output and logsumexp, the gradient of its output (o_proj's input gradient) and every saved tensor of
the ops before it are alive (`sdpa_released`, `sdpa_transient_bytes`). After the core (sdpa or eager) has run
backward, autograd runs the ops made last first (`ReadyQueue` ordered by
sequence_nr): k's RoPE, q's RoPE, v's view and v_proj, k_norm and k_proj, q_norm and q_proj, the input norm. Two
moments there hold q-sized gradients (tokens × heads·head_dim, `_q_numel`) beside the layer's remaining saved
tensors; they are the layer's peak when the attention is wider than the MLP:
- q's RoPE backward (`q_embed = q * cos + rotate_half(q) * sin`): the gradient of q_embed (kept for `q * cos`'s
  backward, which runs last), `grad * sin` and rotate_half's two zero-filled `slice_backward` outputs, or under
  autocast without q_norm `q * cos`'s backward (`rope_q_bytes`); k's accumulated RoPE gradient and v's core
  gradient wait beside them.
- q_norm's backward (families with `qk_norm`): RMSNorm in fp32 (`x.to(float32)`, `x.pow(2).mean(-1)`,
  `x * rsqrt(...)`); at `PowBackward0`'s last product five fp32 q-sized tensors are alive: `x * rsqrt`'s input
  gradient, mean's `grad.expand() / d`, and pow_backward's `x.pow(1)`, `2 * x.pow(1)` and `grad * (2 * x.pow(1))`;
  x itself (saved by pow) too, and the layer input's gradient accumulated from k_proj and v_proj.
Sources: transformers 5.23 `models/qwen3/modeling_qwen3.py` (`Qwen3RMSNorm.forward`, `rotate_half`,
`apply_rotary_pos_emb`, `Qwen3Attention.forward`), `models/llama/modeling_llama.py` (`LlamaRotaryEmbedding`: cos and
sin cast to the hidden states' dtype); torch 2.13 `tools/autograd/derivatives.yaml` (`pow.Tensor_Scalar:
pow_backward`, `mean.dim: mean_backward`, `slice.Tensor: slice_backward_wrapper`, `mul.Tensor`),
`torch/csrc/autograd/engine.cpp`.
"""

from __future__ import annotations

from llmem.components.saved import FP32, Saved, _bytes, _sdpa
from llmem.components.sharding import local_numel
from llmem.plan import Method, TrainingPlan
from llmem.spec import ModelSpec

# Saved tensors of the ops before RoPE (alive at its backward): the input norm's, q/k/v's input, the q/k norms'.
_BEFORE_ROPE = ("input (residual stream)", "input_layernorm.", "autocast input casts q/k/v", "q_norm.", "k_norm.")
_QKV_CASTS = "autocast input casts q/k/v"
ROPE_Q_TEMPORARIES = 4  # q_embed's gradient, grad * sin, two slice_backward outputs
NORM_Q_TEMPORARIES = 5  # x * rsqrt's input gradient, mean's div, x.pow(1), 2 * x.pow(1), grad * (2 * x.pow(1))


def applies_rope(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """A llama-like attention (separate q/k/v Linears, RoPE on the whole head) in the full-model tables: not LoRA
    or QLoRA (their own tables), not a derived architecture (its traced backward has every moment), not the
    partial rotary of gpt_neox, fused qkv_proj of phi3 or falcon's own attention (other backward programs)."""
    f = spec.family
    return (f.rope and f.tp_plan and not (f.partial_rotary or f.fused_projections or f.own_attention_core)
            and plan.method is Method.FULL and spec.derived is None)


def applies_q_norm(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """The RoPE families that normalize each head's query (`Qwen3Attention.q_norm`)."""
    return spec.family.qk_norm and applies_rope(spec, plan)


def _q_numel(spec: ModelSpec, plan: TrainingPlan) -> int:
    """tokens × this rank's query heads × head_dim."""
    return plan.batch_size * plan.seq_len * spec.num_heads * spec.head_dim // plan.tp


def _kv_numel(spec: ModelSpec, plan: TrainingPlan) -> int:
    return plan.batch_size * plan.seq_len * spec.num_kv_heads * spec.head_dim // plan.tp


_SDPA_SAVED = ("q_embed (RoPE)", "k_embed (RoPE)", "v_proj", "sdpa output", "sdpa logsumexp")


def applies_sdpa(spec: ModelSpec, plan: TrainingPlan) -> bool:
    return applies_rope(spec, plan) and _sdpa(spec, plan)


def sdpa_released(items: tuple[Saved, ...]) -> int:
    """Bytes of the layer's saved tensors released before sdpa's backward: those of the ops after it (o_proj's input
    is sdpa's output itself), the post-attention norm and the MLP."""
    return sum(s.bytes for s in items if not s.name.startswith(_BEFORE_ROPE + _SDPA_SAVED))


def applies_lora_sdpa(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """LoRA (not QLoRA) on a llama-like dense attention in the hand-written tables with sdpa: the layer's backward
    reaches the same fused sdpa backward as full fine-tuning's (`applies_sdpa`), its frozen o_proj having returned
    sdpa's output gradient."""
    f = spec.family
    return (plan.method is Method.LORA and f.rope and f.tp_plan and spec.derived is None and _sdpa(spec, plan)
            and not (f.partial_rotary or f.fused_projections or f.own_attention_core))


def applies_moe_sdpa(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """The MoE families' llama attention (mixtral, qwen2_moe: no TP plan, so not `applies_rope`) in full
    fine-tuning and under LoRA: the same fused sdpa backward after the MoE block's and o_proj's (LoRA: on LoRA's
    table, `walk.fsdp_layer._lora_sdpa_moment`). The attention-heavy mixtral LoRA plan that once read 2.2 % above
    its walk with this moment (12,704,456 B under --cp 2) peaked in the last layer's routed experts' forward
    (`moe_forward.lora_unsaved_bytes`), not here: 12,704,368 B estimated with both."""
    f = spec.family
    return (spec.is_moe and f.rope and spec.derived is None and _sdpa(spec, plan)
            and plan.method in (Method.FULL, Method.LORA)
            and not (f.partial_rotary or f.fused_projections or f.own_attention_core))


_LORA_BEFORE_SDPA = ("q_proj/k_proj/v_proj",)  # the q/k/v adapters' entries (`lora_activations._INPUT_GROUPS`)


def lora_sdpa_released(items: tuple[Saved, ...]) -> int:
    """`sdpa_released` on a LoRA table (`lora_activations.layer_saved`): the MLP's and o_proj's adapter entries
    (dropout masks and outputs, lora_A outputs, scalings, weight casts) are released by then; the q/k/v adapters'
    stay, their MmBackward0s run after sdpa's."""
    return sum(s.bytes for s in items if not s.name.startswith(_BEFORE_ROPE + _SDPA_SAVED + _LORA_BEFORE_SDPA))


def sdpa_transient_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The gradients in flight when sdpa's backward has allocated its outputs: its output's gradient and q's (q-sized)
    and k's and v's (kv-sized), all in the compute dtype; the residual stream's (param dtype)."""
    cb, _ = _bytes(plan)
    residual = plan.batch_size * plan.seq_len * spec.hidden_size * plan.precision.param_bytes
    return (2 * _q_numel(spec, plan) + 2 * _kv_numel(spec, plan)) * cb + residual


def rope_released(items: tuple[Saved, ...]) -> int:
    """Bytes of the layer's saved tensors released before q's RoPE backward: those of the ops after RoPE (the
    core's q, k, v and output, o_proj's input, the MLP half)."""
    return sum(s.bytes for s in items if not s.name.startswith(_BEFORE_ROPE))


def _query_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The dtype of q and k entering RoPE: q_norm's output (fp32 weight times its half normalized input: the param
    dtype), else q_proj's output (the compute dtype)."""
    return plan.precision.param_bytes if spec.family.qk_norm else _bytes(plan)[0]


def rope_q_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """q's own gradients at the largest instant of its RoPE backward, RoPE's output in e bytes (the param dtype:
    cos and sin are cast to the hidden states' dtype) and q in qd: with qd = e, four q-sized tensors at the second
    `SliceBackward0` (q_embed's gradient, grad * sin, two slice outputs); with qd < e (autocast, no q_norm), at
    `q * cos`'s backward: q_embed's gradient and grad * cos in e, the latter's cast to qd and the accumulated
    rotate_half gradient in qd (mul's backward casts each gradient to its input's dtype)."""
    e, qd = plan.precision.param_bytes, _query_bytes(spec, plan)
    per = ROPE_Q_TEMPORARIES * e if qd == e else 2 * e + 2 * qd
    return _q_numel(spec, plan) * per


def rope_transient_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The gradients in flight at q's RoPE backward: q's (`rope_q_bytes`), k's accumulated gradient (k's dtype),
    v's gradient from the core (compute dtype), the residual stream's (param dtype)."""
    cb, _ = _bytes(plan)
    residual = plan.batch_size * plan.seq_len * spec.hidden_size * plan.precision.param_bytes
    return rope_q_bytes(spec, plan) + _kv_numel(spec, plan) * (_query_bytes(spec, plan) + cb) + residual


def q_norm_released(items: tuple[Saved, ...]) -> int:
    """Bytes of the layer's saved tensors released before q_norm's `PowBackward0`: all but the input norm's, q_proj's
    input (under autocast its own cast: one of the three q/k/v casts) and q_norm's fp32 input."""
    kept = sum(s.bytes for s in items if s.name.startswith(("input (residual stream)", "input_layernorm.",
                                                              "q_norm.input")))
    kept += sum(s.bytes for s in items if s.name.startswith(_QKV_CASTS)) // 3
    return sum(s.bytes for s in items) - kept


def q_norm_transient_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The gradients in flight at q_norm's `PowBackward0`: five fp32 q-sized tensors, the layer input's gradient
    from k_proj and v_proj and the residual stream's (tokens × h each, param dtype)."""
    tokens_h = plan.batch_size * plan.seq_len * spec.hidden_size
    return NORM_Q_TEMPORARIES * _q_numel(spec, plan) * FP32 + 2 * tokens_h * plan.precision.param_bytes


def _before_q_norm(name: str) -> bool:
    return any(f".{k}." in name for k in ("q_proj", "q_norm", "input_layernorm"))


def q_norm_layer_gradient_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The layer's weight gradients made before q_norm's backward: every parameter's but q_proj's, q_norm's and
    the input norm's (none of its own under `--ddp-bucket-view`: each is in its bucket view)."""
    from llmem.components.gradients import freed_at_hook

    if freed_at_hook(plan):
        return 0
    params = spec.memo(("qnorm.after",), lambda: tuple(p for p in spec.layer_params(0) if not _before_q_norm(p.name)))
    return sum(local_numel(p, plan) for p in params) * plan.precision.param_bytes


def q_norm_weight_copy_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Under autocast: q_proj's half weight copy (its MmBackward0 has not run yet)."""
    from llmem.components.autocast import _linear_weights
    from llmem.components.autocast import applies as autocast_applies

    if not autocast_applies(plan):
        return 0
    return sum(local_numel(p, plan) for p in _linear_weights(spec, 0) if ".q_proj." in p.name) \
        * plan.precision.compute_bytes
