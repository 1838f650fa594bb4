"""Fallback for architectures without a closed-form adapter: count parameters on the meta device.

`AutoModelForCausalLM.from_config` under `torch.device("meta")` allocates no memory; the parameter list (tied
weights once) gives exact counts and shapes. Sizes the activation model needs come from the standard config
attributes; the activation table is the Llama-style one, which the spec states as a caveat. This is the only
place the estimator imports torch. Remote code is never executed.
"""

from __future__ import annotations

import copy
import re

from llmem.errors import InputError
from llmem.spec import ModelSpec, ParamTensor

_LAYER = re.compile(r"\.(\d+)\.")


def _version() -> str:
    import transformers

    return transformers.__version__


def meta_spec(config: dict) -> ModelSpec:
    model_type = config["model_type"]
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise InputError("model_type", f"{model_type!r} has no closed-form adapter, and counting it on the meta "
                         "device needs torch and transformers installed") from None
    # a copy: transformers standardizes nested dicts in place (`rope_scaling`), the config is a cache key
    rest = copy.deepcopy({k: v for k, v in config.items() if k not in ("model_type", "architectures", "auto_map")})
    layers = rest.get("num_hidden_layers", rest.get("n_layer", 1))
    if not isinstance(layers, int) or not 1 <= layers <= 4096:
        raise InputError("num_hidden_layers", f"must be a whole number from 1 to 4,096, got {layers!r}")
    if "auto_map" in config:
        raise InputError("model_type", f"{model_type!r} needs trust_remote_code, which llmem never enables; use "
                         "an architecture that transformers ships")
    try:
        cfg = AutoConfig.for_model(model_type, **rest)
    except Exception as e:  # noqa: BLE001 - transformers' config validation raises its own error types
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise InputError("model_type", f"transformers {_version()} cannot read this {model_type!r} config "
                         f"({first}); check the spelling and the sizes") from None
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - bad sizes fail deep inside torch (negative dimension, division by 0)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise InputError("model_type", f"{model_type!r}: transformers could not build this config as a causal "
                         f"language model ({first})") from None
    return _spec(config, model_type, cfg, model)


def _size(text, name: str, default=None) -> int:
    try:
        value = getattr(text, name, None) or default
    except Exception:  # noqa: BLE001 - transformers' heterogeneous configs refuse a global per-layer attribute
        raise InputError(name, "differs between decoder layers in this config (per-layer configs); layers of "
                         "different sizes are not modelled yet") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(name, f"must be a positive whole number in the (text) config, got {value!r}")
    return value


def _layer_prefixes(model) -> dict[str, int]:
    """The decoder layers' module names (`model.layers.3.` -> 3): the list `runtime.model.decoder_layers` finds.
    A parameter of another numbered stack (a byte-level model's local encoder, a vision tower) is not a layer's."""
    from llmem.runtime.model import decoder_layers

    try:
        layers = decoder_layers(model)
    except InputError:  # no declared layer class: any `.N.` is a layer index (the count from the config)
        return {}
    names = {id(m): n for n, m in model.named_modules()}
    return {f"{names[id(layer)]}.": i for i, layer in enumerate(layers)}


def _layer_of(name: str, prefixes: dict[str, int]) -> int | None:
    if not prefixes:
        m = _LAYER.search(name)
        return int(m.group(1)) if m else None
    return next((prefixes[name[:m.end()]] for m in _LAYER.finditer(name) if name[:m.end()] in prefixes), None)


def _spec(config: dict, model_type: str, cfg, model) -> ModelSpec:
    prefixes = _layer_prefixes(model)
    params = [ParamTensor(name, tuple(p.shape), _layer_of(name, prefixes))  # tied weights are listed once
              for name, p in model.named_parameters()]
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if not prefixes and any(p.layer is not None and p.layer >= _size(text, "num_hidden_layers") for p in params):
        raise InputError("model_type", f"{model_type!r}: transformers declares no decoder-layer class for it and its "
                         "numbered module stacks outnumber num_hidden_layers (a vision or audio tower); estimate "
                         "its text model's config instead")
    hidden = _size(text, "hidden_size")
    heads = _size(text, "num_attention_heads")
    spec = ModelSpec(
        model_type=model_type,
        name=str(config.get("_name_or_path") or model_type),
        vocab_size=_size(text, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_size(text, "intermediate_size", 4 * hidden),
        num_layers=len(prefixes) or _size(text, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=_size(text, "num_key_value_heads", heads),
        head_dim=_size(text, "head_dim", max(1, hidden // heads)),
        tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
        caveats=(f"{model_type!r} has no activation table: parameters are exact (meta device), activations use "
                 "the Llama-style layer and may be off",),
    )
    object.__setattr__(spec, "params", tuple(params))
    return spec
