"""Which attention transformers runs for a derived architecture's `--attn sdpa`: its own choice, read from it.

transformers 5.23.0 `PreTrainedModel.get_correct_attn_implementation` (modeling_utils.py:1845-1880) tries sdpa
when no implementation is asked for and falls back to eager when `_sdpa_can_dispatch` raises, which it does for a
class with `_supports_sdpa = False` (modeling_utils.py:1665: e.g. `GptOssPreTrainedModel`, whose attention adds
learned sinks to the softmax, models/gpt_oss/modeling_gpt_oss.py:379). `--attn sdpa` (the default) means "the fused
kernel where the model has one" (`llmem.spec.attention_implementation`), so such a model is traced, estimated and
measured with the eager attention transformers runs for it. The answer is kept on disk beside the traced tables
(`llmem.derive.cache`): a cached estimate imports no transformers.
"""

from __future__ import annotations

from llmem.derive import cache


def _class_supports_sdpa(model_type: str) -> bool:
    """`_supports_sdpa` of transformers' causal-LM class for `model_type` (True when it has none: transformers
    then raises its own error, which the trace reports)."""
    try:
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:  # the estimator's core without transformers: nothing derived to ask about
        return True

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    return bool(getattr(cls, "_supports_sdpa", True)) if cls is not None else True


def supports_sdpa(model_type: str) -> bool:
    """Whether transformers runs sdpa for `model_type` when asked for its default attention (cached on disk)."""
    key = {"model_type": model_type}
    cached = cache.load(key, ("supports sdpa",))
    if isinstance(cached, bool):
        return cached
    from llmem.quiet import quiet_libraries

    with quiet_libraries():  # the modeling module's first import loads the quantizers' libraries (torchao)
        answer = _class_supports_sdpa(model_type)
    return bool(cache.store(key, ("supports sdpa",), answer))
