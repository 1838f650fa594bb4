"""What the derived path reads from a config alone, without tracing: the sliding-window band a sequence length falls
in (`band`), what it refuses statically (`static_refusal`, asked of every preset without torch) and the dropout keys
set above 0 (`dropout_keys`: a traced dropout makes the tables per device profile). `llmem.derive.tables` re-exports
them."""

from __future__ import annotations

import copy

from llmem.derive import experts
from llmem.derive.fit import REGIMES
from llmem.errors import InputError
from llmem.quiet import quiet_libraries

_LOWEST_WINDOW = max(s for kind in REGIMES for pts in REGIMES[kind][:2] for _, s in pts)  # see `band`


def band(config: dict, seq: int) -> int:
    """0, or the sliding window W when seq >= W: transformers 5.23 `masking_utils._ignore_causal_mask_sdpa` builds
    an explicit sliding-window mask (instead of sdpa's `is_causal`) once the key length reaches W, so the traced
    tensors change there; a plan at or above W is traced at W + the regime's points, one below W below it."""
    window = config.get("sliding_window")
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        return 0
    if seq >= window:
        return window
    low = _LOWEST_WINDOW
    if window <= low:
        raise InputError("sliding_window", f"{window} is traced only for windows above {low} tokens, or for "
                         f"--seq-len at least the window; use --seq-len {window} or more")
    return 0


def static_refusal(config: dict, also: tuple = ()) -> InputError | None:
    """What the config alone says the derived path refuses, read without torch (the preset list asks it of every
    preset): expert layers not derived (`experts.experts_refusal`, read from the config or its text_config). A
    config that passes may still be refused when traced (e.g. no sdpa path)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return experts.experts_refusal({**text, **config}, config.get("model_type"), also)


def _dropout_keys(values: dict) -> list[str]:
    return [k for k, v in values.items() if ("dropout" in k or "pdrop" in k) and not k.startswith(("classifier",
            "summary")) and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0]


def dropout_keys(config: dict) -> list[str]:
    """The dropout keys above 0 the config sets, else those its configuration class defaults above 0."""
    keys = _dropout_keys(config)
    if keys:
        return keys
    try:
        from transformers import AutoConfig

        rest = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "auto_map")}
        with quiet_libraries():
            return _dropout_keys(AutoConfig.for_model(config["model_type"], **copy.deepcopy(rest)).to_dict())
    except Exception:  # noqa: BLE001 - a config transformers rejects is named when it is built
        return []
