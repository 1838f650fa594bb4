"""The output layer's module name of an architecture outside `llmem.families`: the module `get_output_embeddings()`
returns on the model built on the meta device (transformers 5.23.0, `modeling_utils.py:1049`: `lm_head` unless the
class names its own, e.g. GPT-NeoX-Japanese's `embed_out`, BioGPT's `output_projection`). A tied head is a module of
its own whose weight is the embedding's, so the parameter inventory does not show its name. Cached on disk beside the
traced tables (asked only by plans naming the head: `--lora-targets ...,<head>`, `--lora-modules-to-save`)."""

from __future__ import annotations

import copy

from llmem.derive import cache

KEY = ("output_layer",)


def output_layer(config: dict) -> str:
    """The module name of the output Linear (`lm_head` when the model declares none)."""
    cached = cache.load(config, KEY)
    if isinstance(cached, str):
        return cached
    return cache.store(config, KEY, _built(config))


def _built(config: dict) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    rest = copy.deepcopy({k: v for k, v in config.items() if k not in ("model_type", "architectures", "auto_map")})
    with torch.device("meta"):  # (a copy: transformers standardizes `rope_scaling` in place; the config is a key)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **rest))
    head = model.get_output_embeddings()
    return next((n for n, m in model.named_modules() if m is head), "lm_head") if head is not None else "lm_head"
