"""Which config.json keys transformers reads for each name a family's builder asks for, derived from the config
classes themselves (`llmem/config_keys.py` is generated from `generate()` by `scripts/gen_config_keys.py`).

A config class reads a value from one key, from aliases in its `attribute_map` (`PreTrainedConfig.__setattr__`
maps them, transformers 5.23.0 `configuration_utils.py`), from keys its `__init__` pops (`FalconConfig`'s
`n_embed`) or from a nested dict (`GPTNeoXConfig.rope_parameters["partial_rotary_factor"]`, filled from the legacy
`rotary_pct`) — and ignores every other spelling. So for each family and name this builds the class with a
candidate key set to a marker value and keeps the keys whose value lands in the attribute, highest precedence first
(both set: the one whose value wins). A key the class ignores (OPT's `n_layer`) is then not read by the estimate
either, so the estimate describes the model transformers builds from the same file.
"""

from __future__ import annotations

import itertools

# The config attribute (dotted: inside a dict attribute) that holds each name, first one the class has.
TARGETS = {
    "num_layers": ("num_hidden_layers",),
    "num_heads": ("num_attention_heads",),
    "num_kv_heads": ("num_key_value_heads", "num_kv_heads"),
    "num_experts": ("num_local_experts", "num_experts"),
    "n_positions": ("max_position_embeddings",),
    "intermediate_size": ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size"),
    "rotary_pct": ("rope_parameters.partial_rotary_factor", "rotary_pct"),
}
# Spellings seen in published config.json files, tried besides the name, the target and its attribute_map aliases.
SPELLINGS = {
    "vocab_size": ("padded_vocab_size",),
    "hidden_size": ("n_embd", "n_embed", "d_model"),
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "num_heads": ("num_attention_heads", "n_head", "num_heads"),
    "num_kv_heads": ("num_key_value_heads", "num_kv_heads", "n_head_kv"),
    "num_experts": ("num_experts", "num_local_experts"),
    "n_positions": ("n_positions", "max_position_embeddings"),
    "intermediate_size": ("n_inner", "ffn_dim", "ffn_hidden_size"),
    "rotary_pct": ("rotary_pct", "partial_rotary_factor", "rope_parameters.partial_rotary_factor"),
}
_HEAD_COUNTS = ("num_heads", "num_kv_heads")  # markers that keep dividing the default hidden size


def _get(obj, path: str):
    for part in path.split("."):
        obj = obj.get(part) if isinstance(obj, dict) else getattr(obj, part, None)
    return obj


def _has(config, path: str) -> bool:
    head, _, leaf = path.partition(".")
    if not hasattr(config, head):
        return False
    return not leaf or leaf in (getattr(config, head) or {})


def _raw(default, key: str, value) -> dict:
    """A config dict setting `key` (dotted: inside the default's dict attribute) to `value`."""
    head, _, leaf = key.partition(".")
    if not leaf:
        return {key: value}
    return {head: {**(_get(default, head) or {}), leaf: value}}


def _markers(name: str, default) -> tuple | None:
    """Two values unlike the default and each other, of the attribute's type; None for types not probed."""
    if isinstance(default, bool):
        return not default, not default
    if name in _HEAD_COUNTS:
        return 2, 4
    if isinstance(default, float):
        return (0.5, 0.125) if default != 0.5 else (0.75, 0.125)
    if isinstance(default, int) or default is None:
        base = default or 64
        return 2 * base, 4 * base
    return None


def _reads(cls, default, key: str, target: str, value) -> bool:
    try:
        return _get(cls(**_raw(default, key, value)), target) == value
    except Exception:  # a marker the class rejects: it does not read that key as this name
        return False


def _wins(cls, default, first: str, second: str, target: str, values: tuple) -> bool:
    raw = {**_raw(default, second, values[1])}
    nested = _raw(default, first, values[0])
    for k, v in nested.items():
        raw[k] = {**raw[k], **v} if isinstance(v, dict) and isinstance(raw.get(k), dict) else v
    try:
        return _get(cls(**raw), target) == values[0]
    except Exception:
        return False


def keys_for(cls, name: str) -> tuple[str, ...] | None:
    """The keys `cls` reads for `name`, highest precedence first: () if the class has no attribute for it (every
    key is ignored), None if the attribute's type is not probed (lists, strings: the lookup's fallback applies)."""
    default = cls()
    target = next((t for t in TARGETS.get(name, (name,)) if _has(default, t)), None)
    if target is None:
        return ()
    values = _markers(name, _get(default, target))
    if values is None:
        return None
    aliases = [k for k, v in getattr(cls, "attribute_map", {}).items() if v == target]
    candidates = dict.fromkeys([name, target, *aliases, *SPELLINGS.get(name, ())])
    accepted = [k for k in candidates if _reads(cls, default, k, target, values[0])]
    if isinstance(values[0], bool):
        return tuple(accepted)
    wins = {k: sum(_wins(cls, default, k, other, target, values) for other in accepted if other != k)
            for k in accepted}
    return tuple(sorted(accepted, key=lambda k: -wins[k]))


def generate(families: dict) -> dict[str, dict[str, tuple[str, ...]]]:
    """{model_type: {name: keys}} for every family and every name its builder may read (`SPELLINGS`' names, its
    defaults and extras); names whose keys are just (name,) are left out (the lookup's fallback)."""
    from transformers import CONFIG_MAPPING
    from transformers.utils import logging

    logging.set_verbosity_error()  # the markers a class refuses are logged as warnings
    table = {}
    for model_type, family in families.items():
        cls = CONFIG_MAPPING[model_type]
        names = dict.fromkeys(itertools.chain(SPELLINGS, family.defaults, family.extra))
        entry = {}
        for name in names:
            keys = keys_for(cls, name)
            if keys is not None and keys != (name,):
                entry[name] = keys
        table[model_type] = entry
    return table
