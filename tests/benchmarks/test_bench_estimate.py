"""Speed of the pure estimator (pytest-benchmark). Run with `pytest tests/benchmarks --benchmark-enable`;
in the normal suite each benchmark runs once as a smoke test (benchmarks are disabled by default)."""

from llmem.compare import compare
from llmem.estimate import estimate
from llmem.gpus import get_gpu
from llmem.plan import TrainingPlan
from llmem.presets import load_preset
from llmem.spec import ModelSpec

SPEC = ModelSpec.from_config(load_preset("llama-3.3-70b-instruct"))
CAPACITY = get_gpu("h100-80gb").memory_bytes


def test_one_estimate(benchmark):
    est = benchmark(estimate, SPEC, TrainingPlan(gpus=8, zero=3))
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
