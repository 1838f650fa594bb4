"""Speed of the checkpointing planner on a very deep model (issue 11: it used to grow with the square of the layer
count, ~15 minutes at 4,096 layers). Run with `pytest tests/benchmarks --benchmark-enable`; in the normal suite the
benchmark runs once, and the plain test below bounds the time by itself."""

import time

import pytest

from llmem.checkpointing import plan_checkpointing
from llmem.gpus import get_gpu
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec

CAPACITY = get_gpu("h100-80gb").memory_bytes


def deep_llama(layers: int) -> ModelSpec:
    """A llama config with `layers` decoder layers and a small width, built by transformers' LlamaConfig."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=256, intermediate_size=688,
                                      num_attention_heads=4, num_key_value_heads=4, vocab_size=32000)
    return ModelSpec.from_config(config.to_dict())


def test_plan_ckpt_4096_layers(benchmark):
    spec = deep_llama(4096)
    result = benchmark(plan_checkpointing, spec, TrainingPlan(seq_len=2048), CAPACITY)
    assert result.chosen is not None and len(result.options) > 100


def test_plan_ckpt_4096_layers_is_fast():
    """The whole plan (128 options out of 4,096 K) in well under the seconds the old planner took per 256 layers;
    the bound leaves room for a loaded machine (about 0.5 s of CPU time on an idle one)."""
    spec = deep_llama(4096)
    start = time.process_time()
    result = plan_checkpointing(spec, TrainingPlan(seq_len=2048), 120 << 30)  # between full (65 GiB) and none
    assert time.process_time() - start < 5
    chosen = result.chosen
    assert chosen is not None and 0 < chosen.recomputed_layers < 4096
    assert all(not o.fits for o in result.options if o.recomputed_layers < chosen.recomputed_layers)
