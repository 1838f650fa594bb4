"""Speed of the pure estimator (pytest-benchmark). Run with `pytest tests/benchmarks --benchmark-enable`;
in the normal suite each benchmark runs once as a smoke test (benchmarks are disabled by default).

Each estimate gets a new `TrainingPlan`, as when a user changes an option: per-plan work is not reused through the
plan object. `test_estimate_after_an_option_change` also changes the sequence length every round, so only the
terms that do not depend on the micro-batch and the sequence length (sharding, communication buffers, optimizer
states) are found in the spec's memo."""

import itertools

import pytest

from llmem.compare import compare
from llmem.estimate import estimate
from llmem.gpus import get_gpu
from llmem.plan import TrainingPlan
from llmem.presets import load_preset
from llmem.spec import ModelSpec

SPEC = ModelSpec.from_config(load_preset("llama-3.3-70b-instruct"))
EAGER = ModelSpec.from_config(load_preset("gemma-2-2b"))  # eager attention: the walk's extra moments
CAPACITY = get_gpu("h100-80gb").memory_bytes
PLANS = {
    "single": {}, "ddp": {"gpus": 8}, "zero1": {"gpus": 8, "zero": 1}, "zero2": {"gpus": 8, "zero": 2},
    "zero3": {"gpus": 8, "zero": 3}, "zero3-ckpt": {"gpus": 8, "zero": 3, "grad_ckpt": "full"},
    "tp": {"gpus": 8, "tp": 2, "zero": 3}, "lora": {"method": "lora"},
    "qlora": {"method": "qlora", "quant": "nf4", "precision": "bf16"},
}
CASES = [("llama-3.3-70b", name) for name in PLANS] + [("gemma-2-2b", name) for name in PLANS if "lora" not in name]


def test_one_estimate(benchmark):
    est = benchmark(estimate, SPEC, TrainingPlan(gpus=8, zero=3))
    assert est.peak_bytes > 0


@pytest.mark.parametrize(("model", "name"), CASES)
def test_estimate_with_a_fresh_plan(benchmark, model, name):
    """One estimate per scheme and method, a new plan each round (gemma2: no LoRA tables)."""
    spec = EAGER if model == "gemma-2-2b" else SPEC
    estimate(spec, TrainingPlan(**PLANS[name]))  # the spec's structural terms, as in a running app
    est = benchmark.pedantic(estimate, setup=lambda: ((spec, TrainingPlan(**PLANS[name])), {}), rounds=300)
    assert est.peak_bytes > 0


def test_estimate_after_an_option_change(benchmark):
    """ZeRO-3 with the sequence length changed every round."""
    lengths = itertools.count(1024)
    estimate(SPEC, TrainingPlan(gpus=8, zero=3))
    est = benchmark.pedantic(estimate, setup=lambda: ((SPEC, TrainingPlan(gpus=8, zero=3, seq_len=next(lengths))), {}),
                             rounds=300)
    assert est.peak_bytes > 0


def test_compare_one_to_sixty_four_gpus(benchmark):
    def sweep():
        return [compare(SPEC, TrainingPlan(gpus=n), CAPACITY) for n in (1, 2, 4, 8, 16, 32, 64)]

    results = benchmark(sweep)
    assert len(results) == 7


def test_parse_config(benchmark):
    config = load_preset("llama-3.1-405b")
    spec = benchmark(ModelSpec.from_config, config)
    assert spec.total_params > 4e11
