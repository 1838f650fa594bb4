"""The parameter inventory of an architecture outside `llmem.families` (counted on the meta device, cached on disk)
and the spec it gets with its traced tables attached (`derived_spec`)."""

from __future__ import annotations

import copy

from llmem.derive import cache, experts
from llmem.derive.tables import Derived, static_refusal
from llmem.quiet import quiet_libraries
from llmem.spec import ModelSpec


def _refuse_experts(config: dict, also: tuple = ()) -> dict:
    """Expert layers not derived (`experts.experts_refusal`, read with the config class's defaults) are refused;
    returns the spec's expert sizes (`experts.moe_sizes`)."""
    from transformers import AutoConfig

    rest = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "auto_map")}
    cfg = AutoConfig.for_model(config["model_type"], **copy.deepcopy(rest))  # (`rope_scaling` standardized in place)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    values = {key: getattr(text, key, None) for key in experts.FIELDS}
    refusal = experts.experts_refusal(values, config.get("model_type"), also)
    if refusal is not None:
        raise refusal
    return experts.moe_sizes(values)


def derived_spec(config: dict, also: tuple = ()) -> ModelSpec:
    """The meta-device parameter inventory (`llmem.meta.meta_spec`; cached, `inventory`) with the traced activation
    tables attached. What the config alone rules out (`static_refusal`; `also`: MoE model types traced here too,
    `experts.TP_TRACED_MOE` under TP) is refused before anything is built."""
    refusal = static_refusal(config, also)
    if refusal is not None:
        raise refusal
    spec = inventory(config, also)
    options = {"final_logit_softcapping": config.get("final_logit_softcapping")}
    object.__setattr__(spec, "options", options)
    object.__setattr__(spec, "caveats", (f"{spec.model_type!r} has no hand-written table: its activations are "
                                         "traced from transformers on fake tensors",))
    object.__setattr__(spec, "derived", Derived(config, spec.model_type))
    return spec


_SIZES = ("model_type", "name", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
          "num_kv_heads", "head_dim", "tie_word_embeddings")


def inventory(config: dict, also: tuple = ()) -> ModelSpec:
    """The parameter inventory, from the disk cache when this config was counted before (no torch import then),
    else counted on the meta device and cached once the experts check passed."""
    from llmem.spec import ParamTensor

    cached = cache.load(config, ("inventory",))
    if cached is None:
        from llmem.meta import meta_spec

        with quiet_libraries():
            spec = meta_spec(config)
            moe = _refuse_experts(config, also)
        cached = cache.store(config, ("inventory",), {
            "sizes": {k: getattr(spec, k) for k in _SIZES} | moe,
            "params": [[p.name, list(p.shape), p.layer] for p in spec.params]})
    # the name is this config's (as `meta.meta_spec` names it), not that of the config the cached file was counted for
    name = str(config.get("_name_or_path") or cached["sizes"]["model_type"])
    spec = ModelSpec(**(cached["sizes"] | {"name": name}))
    params = tuple(ParamTensor(n, tuple(shape), layer) for n, shape, layer in cached["params"])
    object.__setattr__(spec, "params", params)
    return spec


def is_cached(config: dict) -> bool:
    """Whether this config's inventory is cached (it was derived before: a causal LM transformers builds)."""
    return cache.load(config, ("inventory",)) is not None
