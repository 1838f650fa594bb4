"""FSDP2's forward all-gathers when the decoder layers differ in size: each layer's all-gather and copy-out hold its
own parameters and the previous layer's retained output (`walk.fsdp_forward`), so a larger layer before a smaller
last one is a moment of its own; with layers of one size the last layer's stands for all."""

from llmem.components import Category
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from llmem.walk.fsdp import fsdp_phases
from tests.derive.configs import config

PLAN = TrainingPlan(gpus=2, zero=3, precision="fp32", batch_size=1, seq_len=16)


def _forward_gathers(cfg: dict) -> dict[str, int]:
    phases = fsdp_phases(ModelSpec.from_config(cfg), PLAN)
    return {p.name: p.breakdown for p in phases if p.name.startswith("forward (layer") and "all-gather" in p.name}


def test_a_larger_layer_before_a_smaller_last_layer_has_its_own_gather_moment():
    gathers = _forward_gathers(config("qwen3_moe", num_hidden_layers=4, mlp_only_layers=[3]))  # layer 3 dense
    layers = sorted({name.split()[2] for name in gathers})
    assert layers == ["0", "2", "3"]  # layer 1 gathers as layer 2 does, with fewer activations kept
    comm = {name: b[Category.COMMUNICATION] for name, b in gathers.items()}
    # layer 2's copy-out: the expert layer twice beside layer 1's retained output; layer 3's: the dense layer twice
    assert comm["forward (layer 2 all-gather copy-out)"] > comm["forward (layer 3 all-gather copy-out)"]


def test_layers_of_one_size_gather_at_the_last_layer_only():
    gathers = _forward_gathers(config("qwen3_moe", num_hidden_layers=4))
    assert sorted({name.split()[2] for name in gathers}) == ["0", "3"]
