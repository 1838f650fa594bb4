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


def config(model_type: str, **extra) -> dict:
    """The config dict (`to_json_string`, as a user's config.json) of a small `model_type` model."""
    kwargs = {**BASE, **EXTRA.get(model_type, {}), **extra}
    return json.loads(transformers.AutoConfig.for_model(model_type, **kwargs).to_json_string())
