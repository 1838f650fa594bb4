"""Traced architectures whose decoder layers return their eager attention probabilities, which the model's loop keeps
until the next layer returns (transformers 5.23 `GPTJModel.forward`: `outputs = block(...)`; codegen, gpt_neo, mpt
alike): read off the checkpointed program's trace, not a list of model types (`Derived.returned_probs_bytes`,
`components.returned_probs`). What the trace finds kept against the probabilities' own size; a family whose layers
return only their hidden states has none. Estimates against real runs: tests/derive/test_buffers.py (heavy)."""

from __future__ import annotations

from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from tests.derive.configs import config

GPTJ = {"model_type": "gptj", "n_embd": 32, "n_layer": 2, "n_head": 4, "rotary_dim": 4, "vocab_size": 64,
        "n_positions": 256}


def test_the_previous_layers_returned_probabilities_are_found_kept():
    """fp32, 1 x 256: layer 0's softmax output (batch x heads x seq x seq fp32; `.to(value.dtype)` and the
    zero-probability dropout return it as is) is alive at layer 1's start, though no checkpointed node saves it."""
    plan = TrainingPlan(attn="eager", grad_ckpt="full", batch_size=1, seq_len=256, precision="fp32", device="cpu")
    derived = ModelSpec.from_config(GPTJ).derived
    kept, forward = derived.at(1).returned_probs_bytes(plan)
    assert kept == 1 * 4 * 256 * 256 * 4
    assert forward >= kept  # the last layer's own scores and probabilities
    half = derived.returned_probs_bytes(plan.with_(precision="bf16-mixed"))[0]  # autocast: bf16 scores, `.to(v)`
    assert half == kept // 2


def test_layers_returning_hidden_states_alone_keep_nothing():
    plan = TrainingPlan(attn="eager", grad_ckpt="full", batch_size=1, seq_len=256, device="cpu")
    assert ModelSpec.from_config(config("olmo2")).derived.returned_probs_bytes(plan) == (0, 0)
