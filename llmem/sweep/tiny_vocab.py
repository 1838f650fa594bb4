"""A tiny vocabulary in a share of the sweep's small draws (pure, torch-free).

The small catalogue's vocabularies are 4 to 16 times the hidden size, so the loss's fp32 logits gradient always
tops the final norm's backward (`llmem.components.final_norm`), and no drawn plan made that the peak; where the
vocabulary is as small as the hidden size the estimate read 6 to 14 % low without it
(docs/notes/2026-11-27-final-norm-backward.md). From a stream of its own (every other draw stays the same), a share
of the small and derived draws get a vocabulary of exactly the hidden size (special token ids beyond it set to
None); the model keeps its name (the plan's config carries the vocabulary).
"""

from __future__ import annotations

import random

TINY_VOCAB_SHARE = 0.1
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")


def draw_tiny_vocab(seed: int, index: int, config: dict, size: str) -> dict:
    """The config, with `vocab_size` = hidden size in a share of the small and derived draws."""
    rng = random.Random(f"{seed}:{index}:tiny-vocab")
    hidden = config.get("hidden_size") or config.get("n_embd")
    if size not in ("small", "derived") or not hidden or rng.random() >= TINY_VOCAB_SHARE:
        return config
    return with_vocab(config, int(hidden))


def with_vocab(config: dict, vocab: int | None) -> dict:
    """The config with `vocab_size` = `vocab` (None: unchanged) and the special token ids beyond it set to None (an
    embedding's padding_idx must be in the vocabulary). A sweep row records the vocabulary it drew (`vocab_size`),
    so `llmem.sweep.run.reestimate` rebuilds the config that was measured."""
    if vocab is None or config.get("vocab_size") == vocab:
        return config
    out = {**config, "vocab_size": vocab}
    for key in TOKEN_IDS:
        if isinstance(out.get(key), int) and out[key] >= vocab:
            out[key] = None
    return out
