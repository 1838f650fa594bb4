"""Which config.json key each family's *modeling* code reads for each size llmem asks for, found on the models
transformers builds (`llmem/config_keys.py` is generated from `generate()` by `scripts/gen_config_keys.py`).

A config.json spells a size in several ways (`n_layer`, `num_hidden_layers`, `num_layers`, ...). Which one the model
uses is decided in two places: the config class (its `attribute_map`, the keys its `__init__` pops, a nested
`rope_parameters` dict) and the modeling code, which reads the config's attributes — some through `getattr` with a
fallback, so a key the config class has no attribute for is still stored and read (`Qwen2Attention`:
`getattr(config, "head_dim", hidden_size // num_attention_heads)`, transformers 5.23.0). The class alone cannot say;
the built model can. So for each family, name and spelling this builds `AutoModelForCausalLM.from_config` on the meta
device from a small config with the spelling set to one value, then to another: the key is read when the model
differs (its parameter and buffer shapes, and the numbers its modules keep: head counts, head_dim, rotary sizes). Of
two keys read, the one whose value the model takes when both are set comes first.
"""

from __future__ import annotations

import copy
import itertools

# Spellings of each name seen in published config.json files (transformers' attribute_map aliases and older ones),
# dotted: a key inside a dict-valued key.
SPELLINGS = {
    "vocab_size": ("vocab_size", "padded_vocab_size"),
    "hidden_size": ("hidden_size", "n_embd", "n_embed", "d_model"),
    "intermediate_size": ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size"),
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "num_heads": ("num_attention_heads", "n_head", "num_heads"),
    "num_kv_heads": ("num_key_value_heads", "num_kv_heads", "n_head_kv"),
    "head_dim": ("head_dim",),
    "tie_word_embeddings": ("tie_word_embeddings",),
    "num_experts": ("num_experts", "num_local_experts"),
    "n_positions": ("n_positions", "max_position_embeddings"),
    "rotary_pct": ("rotary_pct", "partial_rotary_factor", "rope_parameters.partial_rotary_factor"),
}
# Two values per name that keep the small model valid (heads divide the hidden size, KV heads the heads).
MARKERS = {
    "vocab_size": (256, 320), "hidden_size": (128, 256), "intermediate_size": (96, 160), "num_layers": (2, 3),
    "num_heads": (2, 4), "num_kv_heads": (1, 2), "head_dim": (16, 32), "tie_word_embeddings": (True, False),
    "num_experts": (4, 8), "n_positions": (64, 128), "rotary_pct": (0.25, 0.5),
}
# The small model's other sizes, under the keys every config class reads (`PreTrainedConfig`'s standard names and
# attribute_map); a probed name's spellings are left out of it, so only the probed key sets that name.
BASE = {
    "vocab_size": 192, "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 80, "num_experts_per_tok": 2, "pad_token_id": None, "tie_word_embeddings": False,
}
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
# A key some layouts of a family read and others not is probed on each (a key is read when one of them reads it):
# Falcon's new decoder architecture reads num_kv_heads (`FalconAttention`), the old one is multi-query; a Qwen2-MoE
# layer in mlp_only_layers is a dense MLP of intermediate_size (`Qwen2MoeDecoderLayer`).
VARIANTS = {
    "falcon": ({}, {"new_decoder_architecture": True}),
    "qwen2_moe": ({"num_hidden_layers": 2, "mlp_only_layers": [0]},),
}


def _config(variant: dict, name: str, settings: dict) -> dict:
    """BASE and the family's variant without `name`'s spellings, with `settings` (dotted keys inside a dict)."""
    raw = {k: v for k, v in {**BASE, **variant}.items() if k not in SPELLINGS[name]}
    for key, value in settings.items():
        head, _, leaf = key.partition(".")
        if leaf:
            raw[head] = {**ROPE, **raw.get(head, {}), leaf: value}
        else:
            raw[key] = value
    return raw


def fingerprint(model) -> tuple:
    """What the built model is: its parameters' and buffers' names and shapes, and the numbers its modules keep."""
    shapes = tuple((n, tuple(p.shape)) for n, p in model.named_parameters())
    buffers = tuple((n, tuple(b.shape)) for n, b in model.named_buffers())
    numbers = tuple((name, k, v) for name, m in model.named_modules() for k, v in sorted(vars(m).items())
                    if type(v) in (int, float, bool) and not k.startswith("_") and k != "training")
    return shapes, buffers, numbers


def built(model_type: str, raw: dict) -> tuple | None:
    """The fingerprint of the model transformers builds from `raw` on the meta device; None if it refuses it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.for_model(model_type, **copy.deepcopy(raw))  # (nested dicts standardized in place)
        with torch.device("meta"):
            return fingerprint(AutoModelForCausalLM.from_config(config))
    except Exception:  # noqa: BLE001 - a value the class or the model rejects: that key is no way to set the name
        return None


def keys_for(model_type: str, name: str) -> tuple[str, ...]:
    """The spellings of `name` the model of `model_type` reads, highest precedence first; () when it reads none."""
    found = (_keys_for(model_type, name, variant) for variant in VARIANTS.get(model_type, ({},)))
    return tuple(dict.fromkeys(itertools.chain.from_iterable(found)))


def _keys_for(model_type: str, name: str, variant: dict) -> tuple[str, ...]:
    m1, m2 = MARKERS[name]
    single = {}
    for key in SPELLINGS[name]:
        a, b = (built(model_type, _config(variant, name, {key: m})) for m in (m1, m2))
        if a is not None and b is not None and a != b:
            single[key] = a
    wins = dict.fromkeys(single, 0)
    for k1, k2 in itertools.permutations(single, 2):
        both = built(model_type, _config(variant, name, {k1: m1, k2: m2}))
        wins[k1] += both == single[k1]
    return tuple(sorted(single, key=lambda k: -wins[k]))


def generate(families) -> dict[str, dict[str, tuple[str, ...]]]:
    """{model_type: {name: keys}} for every family and every name of `SPELLINGS`."""
    from transformers.utils import logging

    logging.set_verbosity_error()  # the values a class refuses are logged as warnings
    return {model_type: {name: keys_for(model_type, name) for name in SPELLINGS} for model_type in families}
