"""The HF-config adapter: one `Family` per supported `model_type` (`FAMILIES`).

Each family reads each size from the config.json keys its modeling code reads (`llmem.config_keys`, generated from
the models transformers builds), with the defaults of its configuration class (transformers 5.23.0,
`models/<type>/configuration_<type>.py`), and lists its parameter tensors exactly as the
transformers module creates them (`models/<type>/modeling_<type>.py`). A test compares every family with the real
model instantiated on the meta device, tensor by tensor. The machinery is `llmem.family`; the LayerNorm decoders'
tensor lists are `llmem.families_layernorm`.
"""

from __future__ import annotations

from collections.abc import Callable

from llmem.errors import InputError
from llmem.families_layernorm import (
    _bloom_layer,
    _bloom_outer,
    _falcon_kv_heads,
    _falcon_layer,
    _falcon_outer,
    _gpt2_layer,
    _gpt2_outer,
    _neox_layer,
    _neox_outer,
    _opt_layer,
    _opt_outer,
)
from llmem.family import COL, REP, ROW, Config, Family, _linear, _norm
from llmem.spec import ModelSpec

# --- Llama-like decoders: llama, mistral, qwen2, qwen3, gemma, gemma2, phi3, mixtral, qwen2_moe -----------------


def _llama_attention(p: str, s: ModelSpec, qkv_bias: bool, o_bias: bool) -> list:
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    return (
        _linear(f"{p}.q_proj", q, s.hidden_size, qkv_bias, COL)
        + _linear(f"{p}.k_proj", kv, s.hidden_size, qkv_bias, COL)
        + _linear(f"{p}.v_proj", kv, s.hidden_size, qkv_bias, COL)
        + _linear(f"{p}.o_proj", s.hidden_size, q, o_bias, ROW)
    )


def _gated_mlp(p: str, hidden: int, inter: int, bias: bool = False) -> list:
    return (
        _linear(f"{p}.gate_proj", inter, hidden, bias, COL)
        + _linear(f"{p}.up_proj", inter, hidden, bias, COL)
        + _linear(f"{p}.down_proj", hidden, inter, bias, ROW)
    )


def _llama_outer(c: Config, s: ModelSpec, prefix: str = "model") -> list:
    items = [(f"{prefix}.embed_tokens.weight", (s.vocab_size, s.hidden_size), REP)]
    items += _norm(f"{prefix}.norm", s.hidden_size, False)
    if not s.tie_word_embeddings:
        items.append(("lm_head.weight", (s.vocab_size, s.hidden_size), REP))
    return items


def _llama_layer(qkv_bias: Callable[[Config], bool], o_bias: Callable[[Config], bool] = lambda c: False,
                 qk_norm: bool = False, sandwich_norms: bool = False):
    def layer(c: Config, s: ModelSpec, i: int) -> list:
        p = f"model.layers.{i}"
        bias = bool(qkv_bias(c))
        items = _llama_attention(f"{p}.self_attn", s, bias, bool(o_bias(c)))
        if qk_norm:
            items += _norm(f"{p}.self_attn.q_norm", s.head_dim, False)
            items += _norm(f"{p}.self_attn.k_norm", s.head_dim, False)
        items += _gated_mlp(f"{p}.mlp", s.hidden_size, s.intermediate_size, bool(c.get("mlp_bias")))
        items += _norm(f"{p}.input_layernorm", s.hidden_size, False)
        items += _norm(f"{p}.post_attention_layernorm", s.hidden_size, False)
        if sandwich_norms:
            items += _norm(f"{p}.pre_feedforward_layernorm", s.hidden_size, False)
            items += _norm(f"{p}.post_feedforward_layernorm", s.hidden_size, False)
        return items

    return layer


def _phi3_layer(c: Config, s: ModelSpec, i: int) -> list:
    p = f"model.layers.{i}"
    qkv = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    return (
        _linear(f"{p}.self_attn.o_proj", s.hidden_size, s.num_heads * s.head_dim, False)
        + _linear(f"{p}.self_attn.qkv_proj", qkv, s.hidden_size, False)
        + _linear(f"{p}.mlp.gate_up_proj", 2 * s.intermediate_size, s.hidden_size, False)
        + _linear(f"{p}.mlp.down_proj", s.hidden_size, s.intermediate_size, False)
        + _norm(f"{p}.input_layernorm", s.hidden_size, False)
        + _norm(f"{p}.post_attention_layernorm", s.hidden_size, False)
    )


def _moe_experts(p: str, s: ModelSpec, inter: int) -> list:
    """Router plus experts stored as 3-D tensors (transformers 5 `MixtralExperts`)."""
    e, h = s.num_experts, s.hidden_size
    return (
        _linear(f"{p}.gate", e, h, False)
        + [(f"{p}.experts.gate_up_proj", (e, 2 * inter, h), REP), (f"{p}.experts.down_proj", (e, h, inter), REP)]
    )


def _mixtral_layer(c: Config, s: ModelSpec, i: int) -> list:
    p = f"model.layers.{i}"
    return (
        _llama_attention(f"{p}.self_attn", s, False, False)
        + _moe_experts(f"{p}.mlp", s, s.intermediate_size)
        + _norm(f"{p}.input_layernorm", s.hidden_size, False)
        + _norm(f"{p}.post_attention_layernorm", s.hidden_size, False)
    )


def qwen2_moe_is_sparse(c: Config, s: ModelSpec, i: int) -> bool:
    """transformers `Qwen2MoeDecoderLayer`: sparse unless listed in mlp_only_layers or off the sparse step."""
    step = c.int("decoder_sparse_step")
    dense = c.get("mlp_only_layers") or []
    if not isinstance(dense, list):
        raise InputError("mlp_only_layers", f"must be a list of layer indices, got {dense!r}")
    return i not in dense and s.num_experts > 0 and (i + 1) % step == 0


def _qwen2_moe_layer(c: Config, s: ModelSpec, i: int) -> list:
    p = f"model.layers.{i}"
    items = _llama_attention(f"{p}.self_attn", s, bool(c.get("qkv_bias")), False)
    if qwen2_moe_is_sparse(c, s, i):
        items += _moe_experts(f"{p}.mlp", s, s.moe_intermediate_size)
        items += _gated_mlp(f"{p}.mlp.shared_expert", s.hidden_size, s.shared_expert_intermediate_size)
        items += _linear(f"{p}.mlp.shared_expert_gate", 1, s.hidden_size, False)
    else:
        items += _gated_mlp(f"{p}.mlp", s.hidden_size, s.intermediate_size)
    items += _norm(f"{p}.input_layernorm", s.hidden_size, False)
    items += _norm(f"{p}.post_attention_layernorm", s.hidden_size, False)
    return items


# --- The table -----------------------------------------------------------------------------------------------------

_DROP = ("attention_dropout",)  # eager attention's dropout on the probabilities (transformers default 0.0)
_LLAMA_BASE = dict(tie_word_embeddings=False, num_kv_heads=None, head_dim=None, attention_bias=False, mlp_bias=False)
# `LlamaModel.forward` and the models built on it: RoPE cos/sin and position_ids made once, passed to every layer
_LLAMA_TRAITS = dict(rope=True, position_ids_held=True)
# the dense llama-like families every torchtitan feature was measured on (cp, pp, float8, the reserved replay)
_TORCHTITAN_MEASURED = dict(context_parallel=True, pipeline_stages=True, float8_linears=True, request_stream=True)

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in [
        Family("llama", {**_LLAMA_BASE, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                         "num_layers": 32, "num_heads": 32},
               _llama_layer(lambda c: c.get("attention_bias"), lambda c: c.get("attention_bias")), _llama_outer,
               tp_plan=True, extra=_DROP, **_LLAMA_TRAITS, liger_kernel=True, lora_activations=True,
               **_TORCHTITAN_MEASURED),
        Family("mistral", {**_LLAMA_BASE, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                           "num_layers": 32, "num_heads": 32, "num_kv_heads": 8},
               _llama_layer(lambda c: False), _llama_outer, tp_plan=True, extra=_DROP, **_LLAMA_TRAITS,
               liger_kernel=True, lora_activations=True, sliding_window_default=4096, **_TORCHTITAN_MEASURED),
        Family("qwen2", {**_LLAMA_BASE, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
                         "num_layers": 32, "num_heads": 32, "num_kv_heads": 32},
               _llama_layer(lambda c: True), _llama_outer, tp_plan=True, extra=_DROP, **_LLAMA_TRAITS,
               window_layers="from-max", liger_kernel=True, lora_activations=True, **_TORCHTITAN_MEASURED),
        Family("qwen3", {**_LLAMA_BASE, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
                         "num_layers": 32, "num_heads": 32, "num_kv_heads": 32, "head_dim": 128},
               _llama_layer(lambda c: c.get("attention_bias"), lambda c: c.get("attention_bias"), qk_norm=True),
               _llama_outer, tp_plan=True, extra=_DROP, **_LLAMA_TRAITS, qk_norm=True, window_layers="from-max",
               liger_kernel=True, lora_activations=True, **_TORCHTITAN_MEASURED),
        Family("gemma", {**_LLAMA_BASE, "vocab_size": 256000, "hidden_size": 3072, "intermediate_size": 24576,
                         "num_layers": 28, "num_heads": 16, "num_kv_heads": 16, "head_dim": 256,
                         "tie_word_embeddings": True},
               _llama_layer(lambda c: c.get("attention_bias"), lambda c: c.get("attention_bias")), _llama_outer,
               tp_plan=True, extra=_DROP, **_LLAMA_TRAITS, unit_offset_norm=True, scaled_embeddings=True,
               liger_kernel=True, lora_activations=True, context_parallel=True),
        Family("gemma2", {**_LLAMA_BASE, "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216,
                          "num_layers": 26, "num_heads": 8, "num_kv_heads": 4, "head_dim": 256,
                          "tie_word_embeddings": True, "attn_logit_softcapping": 50.0,
                          "final_logit_softcapping": 30.0},
               _llama_layer(lambda c: c.get("attention_bias"), lambda c: c.get("attention_bias"),
                            sandwich_norms=True), _llama_outer, tp_plan=True,
               extra=(*_DROP, "attn_logit_softcapping", "final_logit_softcapping"), **_LLAMA_TRAITS, sdpa=False,
               sliding_window_layers=True, unit_offset_norm=True, sandwich_norms=True, scaled_embeddings=True,
               liger_kernel=True),
        Family("phi3", {**_LLAMA_BASE, "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
                        "num_layers": 32, "num_heads": 32, "resid_pdrop": 0.0, "embd_pdrop": 0.0},
               _phi3_layer, _llama_outer, extra=(*_DROP, "resid_pdrop", "embd_pdrop", "rotary_pct"), **_LLAMA_TRAITS,
               fused_projections=True, residual_dropout=True, embedding_dropout=("embd_dropout", "embd_pdrop"),
               liger_kernel=True),
        Family("mixtral", {**_LLAMA_BASE, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                           "num_layers": 32, "num_heads": 32, "num_kv_heads": 8, "num_experts": 8,
                           "num_experts_per_tok": 2},
               _mixtral_layer, _llama_outer, extra=_DROP, **_LLAMA_TRAITS, grouped_experts=True,
               routing_weights_fp32=True, topk_renormalized=True, liger_kernel=True, lora_activations=True,
               context_parallel=True),
        Family("qwen2_moe", {**_LLAMA_BASE, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
                             "num_layers": 24, "num_heads": 16, "num_kv_heads": 16, "num_experts": 60,
                             "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                             "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1,
                             "mlp_only_layers": [], "qkv_bias": True},
               _qwen2_moe_layer, _llama_outer, extra=("norm_topk_prob", *_DROP), **_LLAMA_TRAITS,
               grouped_experts=True, shared_expert=True, lora_activations=True, both_masks=True,
               window_layers="even-below-max", context_parallel=True),
        Family("gpt2", {"vocab_size": 50257, "hidden_size": 768, "intermediate_size": None, "num_layers": 12,
                        "num_heads": 12, "tie_word_embeddings": True, "n_positions": 1024, "resid_pdrop": 0.1,
                        "embd_pdrop": 0.1, "attn_pdrop": 0.1},
               _gpt2_layer, _gpt2_outer, norm="layer",
               extra=("resid_pdrop", "embd_pdrop", "attn_pdrop"), conv1d=True, mlp_activation="gelu-new",
               learned_positions="wpe", embedding_dropout=("embd_pdrop", "embd_pdrop"),
               forward_locals=("inputs_embeds", "position_embeds"), last_block_moments=True),
        Family("opt", {"vocab_size": 50272, "hidden_size": 768, "intermediate_size": 3072, "num_layers": 12,
                       "num_heads": 12, "tie_word_embeddings": True, "max_position_embeddings": 2048,
                       "word_embed_proj_dim": None, "do_layer_norm_before": True, "enable_bias": True,
                       "_remove_final_layer_norm": False, "layer_norm_elementwise_affine": True, "dropout": 0.1,
                       "attention_dropout": 0.0},
               _opt_layer, _opt_outer, norm="layer",
               extra=("dropout", "attention_dropout"), embed_projection=True, mlp_activation="relu",
               learned_positions="embed_positions", batched_position_ids=True,
               forward_locals=("inputs_embeds", "position_embeds", "position_ids", "position_attention_mask")),
        Family("gpt_neox", {"vocab_size": 50432, "hidden_size": 6144, "intermediate_size": 24576, "num_layers": 44,
                            "num_heads": 64, "tie_word_embeddings": False, "attention_bias": True,
                            "rotary_pct": 0.25, "attention_dropout": 0.0, "hidden_dropout": 0.0},
               _neox_layer, _neox_outer, norm="layer",
               extra=("use_parallel_residual", "rotary_pct", "attention_dropout", "hidden_dropout"),
               rope=True, partial_rotary=True,
               mlp_activation="gelu", embedding_dropout=("emb_dropout", "hidden_dropout"),
               forward_locals=("position_ids", "undropped_embeds", "eager_mask"), parallel_residual_sum=True),
        Family("falcon", {"vocab_size": 65024, "hidden_size": 4544, "num_layers": 32, "num_heads": 71,
                          "num_kv_heads": None, "tie_word_embeddings": True, "new_decoder_architecture": False,
                          "multi_query": True, "parallel_attn": True, "bias": False, "num_ln_in_parallel_attn": None},
               _falcon_layer, _falcon_outer, norm="layer", kv_heads=_falcon_kv_heads,
               extra=("new_decoder_architecture", "parallel_attn", "attention_dropout", "hidden_dropout"),
               rope=True, own_attention_core=True, returns_attention_probs=True,
               mlp_activation="gelu", transposed_weight_matmul=True),
        Family("bloom", {"vocab_size": 250880, "hidden_size": 64, "num_layers": 2, "num_heads": 8,
                         "tie_word_embeddings": True},
               _bloom_layer, _bloom_outer, norm="layer",
               extra=("attention_dropout", "hidden_dropout"), sdpa=False, mlp_activation="bloom-gelu",
               embedding_norm=True, forward_locals=("alibi", "eager_mask"), attention_adds_residual=True,
               returns_attention_probs=True, returned_probs_dtype="compute"),
    ]
}


def with_trait(trait: str) -> tuple[str, ...]:
    """The modelled families whose `Family.<trait>` is true, in the table's order (refusal messages list them)."""
    return tuple(model_type for model_type, family in FAMILIES.items() if getattr(family, trait))


def has_trait(model_type: str, trait: str) -> bool:
    """Whether `model_type` is a modelled family whose `Family.<trait>` is true (false for any other type)."""
    family = FAMILIES.get(model_type)
    return family is not None and bool(getattr(family, trait))
