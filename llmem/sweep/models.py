"""The models a sweep draws from, one per supported family (torch-free).

`small`: tiny configs as the CPU accuracy suite builds them (hidden 64, 2-3 layers, 4 heads; the rest is filled in
by transformers' config class of the family), a training step in a second or two on CPU. `derived`: tiny configs
of architectures outside the hand-written families, whose layers the estimate traces from transformers
(`llmem.derive`), drawn apart so that the catalogue of the earlier sweeps (and so their draws) stays as it was.
`full`: the bare
`{"model_type": ...}`, i.e. the defaults of transformers' config class of the family (Llama-2-7B for llama, ...),
for fake-tensor simulation.
"""

from __future__ import annotations

from llmem.errors import InputError

SIZES = ("small", "derived", "full")

SMALL: dict[str, dict] = {
    "llama-gqa": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
                  "max_position_embeddings": 256, "tie_word_embeddings": False},
    "llama-mha-tied": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
                       "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1000,
                       "max_position_embeddings": 256, "tie_word_embeddings": True},
    "mistral": {"model_type": "mistral", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 768,
                "max_position_embeddings": 256, "sliding_window": None},
    "qwen2": {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 640, "max_position_embeddings": 256,
              "tie_word_embeddings": True},
    "qwen3": {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512,
              "max_position_embeddings": 256, "tie_word_embeddings": False},
    "gemma": {"model_type": "gemma", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 1024,
              "max_position_embeddings": 256, "pad_token_id": 0},
    "gemma2": {"model_type": "gemma2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
               "max_position_embeddings": 256, "pad_token_id": 0, "query_pre_attn_scalar": 16, "sliding_window": 32},
    "phi3": {"model_type": "phi3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 512, "max_position_embeddings": 256,
             "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 600, "n_positions": 256},
    "opt": {"model_type": "opt", "hidden_size": 64, "ffn_dim": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
            "vocab_size": 512, "max_position_embeddings": 256, "word_embed_proj_dim": 64},
    "gpt_neox": {"model_type": "gpt_neox", "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "vocab_size": 512, "max_position_embeddings": 256, "rotary_pct": 0.25},
    "falcon": {"model_type": "falcon", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "vocab_size": 512, "new_decoder_architecture": False, "multi_query": True, "parallel_attn": True,
               "bias": False},
    "bloom": {"model_type": "bloom", "hidden_size": 64, "n_layer": 2, "n_head": 4, "vocab_size": 512},
    "mixtral": {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
                "vocab_size": 512, "max_position_embeddings": 256},
    "qwen2_moe": {"model_type": "qwen2_moe", "hidden_size": 64, "intermediate_size": 128,
                  "moe_intermediate_size": 48, "shared_expert_intermediate_size": 96, "num_experts": 4,
                  "num_experts_per_tok": 2, "decoder_sparse_step": 1, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
                  "max_position_embeddings": 256},
}


_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 256}
_MLA = {"num_key_value_heads": 4, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
        "n_shared_experts": 1, "first_k_dense_replace": 0, "moe_intermediate_size": 48, "n_routed_experts": 4,
        "num_experts_per_tok": 2}
_NO_SPECIAL_TOKENS = {"pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
DERIVED: dict[str, dict] = {name: {"model_type": name.split("-")[0], **_TINY, **extra} for name, extra in {
    "olmo2": {}, "granite": {}, "starcoder2": {}, "stablelm": {}, "phi": {}, "cohere": {},
    "smollm3": _NO_SPECIAL_TOKENS, "glm4": {"pad_token_id": None},
    "gemma3_text": {"head_dim": 16, "sliding_window": 32},  # sequences above the window: local and global layers
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2, "pad_token_id": None, "eos_token_id": None},
    "granitemoeshared": {"num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 96},
    "deepseek_v3": {**_MLA, "q_lora_rank": 32, "n_group": 2, "topk_group": 1},
    "glm4_moe": {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "n_shared_experts": 1,
                 "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1, "pad_token_id": None},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16, "sliding_window": 32},
}.items()}


def full_models() -> dict[str, dict]:
    """Every supported family at the defaults of its transformers config class."""
    from llmem.families import FAMILIES

    return {name: {"model_type": name} for name in FAMILIES}


def models(size: str) -> dict[str, dict]:
    if size not in SIZES:
        raise InputError("size", f"{size!r} is not one of: {', '.join(SIZES)}")
    return dict(SMALL) if size == "small" else dict(DERIVED) if size == "derived" else full_models()


def tp_capable(config: dict) -> bool:
    """Whether the family has the Megatron TP plan (separate q/k/v/o and gate/up/down Linears)."""
    from llmem.families import FAMILIES

    family = FAMILIES.get(config.get("model_type", ""))
    return bool(family and family.tp_plan)


# PEFT target names per family (besides all-linear): an attention pair and the MLP, as transformers names them.
LORA_TARGETS: dict[str, tuple[str, ...]] = {
    "gpt2": ("c_attn", "c_attn,c_proj,c_fc"),
    "opt": ("q_proj,v_proj", "fc1,fc2"),
    "gpt_neox": ("query_key_value", "dense_h_to_4h,dense_4h_to_h"),
    "falcon": ("query_key_value", "dense_h_to_4h,dense_4h_to_h"),
    "bloom": ("query_key_value", "dense_h_to_4h,dense_4h_to_h"),
    "phi3": ("qkv_proj", "gate_up_proj,down_proj"),
    "mixtral": ("q_proj,v_proj", "o_proj"),
    "qwen2_moe": ("q_proj,v_proj", "o_proj"),
    "phi": ("q_proj,v_proj", "fc1,fc2"),
    "starcoder2": ("q_proj,v_proj", "c_fc,c_proj"),
    "glm4": ("q_proj,v_proj", "gate_up_proj,down_proj"),
    "deepseek_v3": ("q_b_proj,kv_b_proj", "o_proj"),
    **{moe: ("q_proj,v_proj", "o_proj") for moe in ("qwen3_moe", "olmoe", "granitemoeshared", "gpt_oss")},
}
LLAMA_LIKE_TARGETS = ("q_proj,v_proj", "gate_proj,up_proj,down_proj")


def lora_targets(config: dict) -> tuple[str, ...]:
    return ("all-linear", *LORA_TARGETS.get(config.get("model_type", ""), LLAMA_LIKE_TARGETS))
