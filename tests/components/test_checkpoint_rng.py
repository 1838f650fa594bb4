"""A checkpointed layer keeps the CPU RNG state it stashed at forward until its backward (a real run)."""

import weakref

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from llmem.components import activations as act  # noqa: E402
from llmem.plan import TrainingPlan  # noqa: E402

CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64}


def test_forward_rng_state_alive_at_layer_backward(monkeypatch):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**CONFIG))
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    states, phase = [], {"v": "forward"}
    real = torch.get_rng_state

    def recording():
        t = real()
        states.append((phase["v"], weakref.ref(t), t.nbytes))
        return t

    monkeypatch.setattr(torch, "get_rng_state", recording)
    alive = {}
    for i, layer in enumerate(model.model.layers):
        layer.register_full_backward_pre_hook(
            lambda *_, i=i: alive.update({i: [r() is not None for p, r, _ in states if p == "forward"]}))
    ids = torch.randint(0, 128, (2, 32))
    loss = model(input_ids=ids, labels=ids).loss
    phase["v"] = "backward"
    loss.backward()
    forward = [s for s in states if s[0] == "forward"]
    assert len(forward) == 2  # one stash per checkpointed layer
    assert alive[1] == [True, True] and alive[0][0]  # layer 0's stays until its own backward
    plan = TrainingPlan(batch_size=2, seq_len=32, grad_ckpt="full", device="cpu")
    assert all(nbytes == act.checkpoint_rng_state_bytes(plan) for _, _, nbytes in forward)
    assert act.checkpoint_rng_state_bytes(plan.with_(device="cuda")) == 0  # a CPU tensor: not device memory
    assert act.checkpoint_rng_state_bytes(plan.with_(grad_ckpt="none")) == 0
