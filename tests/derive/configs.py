"""Small configs of architectures outside the hand-written families, built by transformers' own config classes."""

import json

import transformers

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256)
EXTRA = {
    "olmo2": {}, "granite": {}, "starcoder2": {}, "stablelm": {}, "phi": {}, "cohere": {},
    "smollm3": {"pad_token_id": None, "bos_token_id": None, "eos_token_id": None},
    "glm4": {"pad_token_id": None},
    "gemma3_text": {"head_dim": 16, "sliding_window": 32},
}

# mixture-of-experts (`llmem.derive.experts`): 4 experts, top 2, every layer with experts
_MLA = dict(num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
            n_shared_experts=1, first_k_dense_replace=0, moe_intermediate_size=48, n_routed_experts=4,
            num_experts_per_tok=2)
MOE = {
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2, "pad_token_id": None, "eos_token_id": None},
    "flex_olmo": {"num_experts": 4, "num_experts_per_tok": 2, "pad_token_id": None, "eos_token_id": None},
    "granitemoe": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "granitemoeshared": {"num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 96},
    "deepseek_v2": {**_MLA, "q_lora_rank": None, "n_group": 1, "topk_group": 1},
    "deepseek_v3": {**_MLA, "q_lora_rank": 32, "n_group": 2, "topk_group": 1},
    "glm4_moe": {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "n_shared_experts": 1,
                 "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1, "pad_token_id": None},
    "minimax_m2": {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16, "bos_token_id": None,
                   "eos_token_id": None},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16, "sliding_window": 32},
}


def config(model_type: str, **extra) -> dict:
    """The config dict (`to_json_string`, as a user's config.json) of a small `model_type` model."""
    kwargs = {**BASE, **EXTRA.get(model_type, {}), **MOE.get(model_type, {}), **extra}
    return json.loads(transformers.AutoConfig.for_model(model_type, **kwargs).to_json_string())


def assert_estimate_near_measure(cfg: dict, plan, tolerance: float, label: str = ""):
    """`estimate` of `plan` on `cfg` within `tolerance` of one CPU rank's measured peak (`measure_rank`); the
    figures printed (run with -s). Returns the estimate."""
    from llmem.estimate import estimate
    from llmem.measure.run import measure_rank
    from llmem.spec import ModelSpec

    est = estimate(ModelSpec.from_config(cfg), plan)
    measured = measure_rank(cfg, plan)["peak_bytes"]
    print(f"{label}: estimate {est.peak_bytes:,} measured {measured:,} "
          f"({(est.peak_bytes - measured) / measured:+.3%}, {est.peak_phase})")
    assert abs(est.peak_bytes - measured) <= tolerance * measured
    return est
