"""The traced tables of a shallower prefix (`llmem.derive.depth`) against the full-depth trace, to the byte: for each
model type of `depth.VERIFIED` (a small config of that type, deep enough that a prefix is traced) and a few plans
(full and LoRA, fp32 and bf16-mixed, micro-batch 1 and 2, a dropout on the cuda profile, FSDP2's half adapters,
`--grad-ckpt full`, TP 2 with and without LoRA), `Derived._trace_and_fit` of the prefix and of every layer
(plan_depth off) as JSON; a plan the type refuses (TP without a plan in its config) is printed and skipped.
Dense layers among expert layers (`MIXED`: DeepSeek's first_k_dense_replace, Qwen3-MoE's mlp_only_layers,
decoder_sparse_step) are cases of their own. `python scripts/check_depth.py [--types opt,gpt2,qwen3_moe+step2]`:
prints each case, its trace times and `same`/`DIFFERENT`; exit 1 on a difference. No disk cache is read or written."""

from __future__ import annotations

import argparse
import json
import sys
import time

HAND = {  # the hand-written families traced for LoRA (no LoRA table), small configs as in the accuracy suite
    "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "vocab_size": 600, "n_positions": 256},
    "opt": {"model_type": "opt", "hidden_size": 64, "ffn_dim": 256, "num_attention_heads": 4, "vocab_size": 512,
            "max_position_embeddings": 256, "word_embed_proj_dim": 64},
    "gpt_neox": {"model_type": "gpt_neox", "hidden_size": 64, "intermediate_size": 256, "num_attention_heads": 4,
                 "vocab_size": 512, "max_position_embeddings": 256, "rotary_pct": 0.25},
    "falcon": {"model_type": "falcon", "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 512,
               "new_decoder_architecture": False, "multi_query": True, "parallel_attn": True, "bias": False},
    "bloom": {"model_type": "bloom", "hidden_size": 64, "n_head": 4, "vocab_size": 512},
    "phi3": {"model_type": "phi3", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
             "num_key_value_heads": 4, "vocab_size": 512, "max_position_embeddings": 256, "pad_token_id": 0,
             "bos_token_id": 1, "eos_token_id": 2},
    "gemma2": {"model_type": "gemma2", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 256,
               "pad_token_id": 0, "query_pre_attn_scalar": 16, "sliding_window": 32},
}
PLANS = {  # plan fields; "half": FSDP2's bf16-mixed LoRA tables (`Derived.with_half_adapters`)
    "full fp32 b1": {"precision": "fp32"},
    "lora bf16-mixed b2 cuda dropout": {"method": "lora", "batch_size": 2, "device": "cuda", "lora_dropout": 0.1},
    "lora half adapters ckpt": {"method": "lora", "grad_ckpt": "full", "half": True},
    "lora tp2 bf16-mixed q,v": {"method": "lora", "gpus": 2, "tp": 2, "lora_targets": "q_proj,v_proj"},
    "full tp2 bf16-mixed b2": {"gpus": 2, "tp": 2, "batch_size": 2},
}
# PEFT's ParamWrapper (LoRA on experts) refuses a LoRA dropout
MOE = ("mixtral", "gpt_oss", "qwen3_moe", "deepseek_v2", "deepseek_v3", "glm4_moe")
EAGER = ("gpt_oss",)  # no sdpa path in transformers 5.23


# dense and expert layers mixed (the layer's modules differ, `depth.layer_modules`): case name -> (model type, fields)
MIXED = {
    "deepseek_v2+dense1": ("deepseek_v2", {"first_k_dense_replace": 1}),
    "deepseek_v3+dense2": ("deepseek_v3", {"first_k_dense_replace": 2}),
    "glm4_moe+dense1": ("glm4_moe", {"first_k_dense_replace": 1}),
    "qwen3_moe+step2": ("qwen3_moe", {"decoder_sparse_step": 2}),
    "qwen3_moe+mlp_only": ("qwen3_moe", {"mlp_only_layers": [0, 3]}),
}


def case_config(model_type: str, layers: int) -> dict:
    if model_type in MIXED:
        from tests.derive.configs import config

        return config(MIXED[model_type][0], num_hidden_layers=layers + 2, **MIXED[model_type][1])
    if model_type in HAND:
        key = "n_layer" if model_type == "bloom" else "num_hidden_layers"
        return {**HAND[model_type], key: layers}
    from tests.derive.configs import config

    return config(model_type, num_hidden_layers=layers)


def fits(config: dict, fields: dict, shallow: bool) -> tuple[str, float]:
    from llmem.derive import depth
    from llmem.derive.tables import Derived
    from llmem.plan import TrainingPlan

    fields = dict(fields)
    half = fields.pop("half", False)
    if config["model_type"] in MOE and fields.get("method") == "lora":
        fields |= {"lora_dropout": 0.0, "device": "cpu"}
    if config["model_type"] in EAGER:
        fields["attn"] = "eager"
    derived = Derived(config, config["model_type"])
    if half:
        derived = derived.with_half_adapters()
    verified = depth.VERIFIED
    depth.VERIFIED = verified if shallow else ()
    try:
        start = time.process_time()
        out = derived._trace_and_fit(derived.key(TrainingPlan(seq_len=64, **fields)))
        return json.dumps(out, sort_keys=True), time.process_time() - start
    finally:
        depth.VERIFIED = verified


def main() -> int:
    from llmem.derive import cache, depth
    from llmem.errors import InputError

    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default=",".join(depth.VERIFIED[1:]), help=f"model types, or {', '.join(MIXED)}")
    ap.add_argument("--plans", default=",".join(PLANS))
    args = ap.parse_args()
    cache.load = lambda config, key: None  # noqa: ARG005 - both depths traced, never read from disk
    cache.store = lambda config, key, fitted: json.loads(json.dumps(fitted))  # noqa: ARG005
    bad = 0
    for model_type in args.types.split(","):
        config = case_config(model_type, 8 if model_type == "gemma2" else 5)
        for name in args.plans.split(","):
            try:
                (deep, t_deep), (short, t_short) = fits(config, PLANS[name], False), fits(config, PLANS[name], True)
            except InputError as e:
                print(f"{model_type:12} {name:34} refused: {e}", flush=True)
                continue
            bad += deep != short
            print(f"{model_type:12} {name:34} full depth {t_deep:5.1f} s, prefix {t_short:5.1f} s: "
                  f"{'same' if deep == short else 'DIFFERENT'}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
