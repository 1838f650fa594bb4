"""A share of the small draws gets a vocabulary of the hidden size; every other field, and the other draws, stay."""

from llmem.sweep.draw import draw
from llmem.sweep.models import SMALL
from llmem.sweep.tiny_vocab import TINY_VOCAB_SHARE


def _hidden(config: dict) -> int:
    return config.get("hidden_size") or config["n_embd"]


def test_a_share_of_the_small_draws_has_a_vocabulary_of_the_hidden_size():
    drawn = draw(400, seed=21)
    tiny = [d for d in drawn if d.config["vocab_size"] == _hidden(d.config)]
    assert 0.5 * TINY_VOCAB_SHARE * len(drawn) <= len(tiny) <= 2 * TINY_VOCAB_SHARE * len(drawn)
    assert all(d.config == SMALL[d.model] for d in drawn if d not in tiny)
    for d in tiny:  # the same model otherwise; no special token outside the vocabulary
        assert {k: v for k, v in d.config.items() if k != "vocab_size" and not k.endswith("token_id")} == \
            {k: v for k, v in SMALL[d.model].items() if k != "vocab_size" and not k.endswith("token_id")}
        assert all(not isinstance(d.config.get(k), int) or d.config[k] < d.config["vocab_size"]
                   for k in ("pad_token_id", "bos_token_id", "eos_token_id"))


def test_the_full_size_draws_keep_their_vocabularies():
    assert all(d.config.get("vocab_size") is None for d in draw(50, seed=21, size="full", device="cuda"))
