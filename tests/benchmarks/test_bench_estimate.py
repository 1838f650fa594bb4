"""Speed of the pure estimator (pytest-benchmark). Run with `pytest tests/benchmarks --benchmark-enable`;
in the normal suite each benchmark runs once as a smoke test (benchmarks are disabled by default).

Each estimate gets a new `TrainingPlan`. `test_estimate_with_a_fresh_plan` asks a plan equal to an earlier one (the
table again after a GPU-type change, an option toggled back): its walk is found in the spec's memo.
`test_estimate_after_an_option_change` changes the sequence length every round: the plan was never asked, its walk
is not in the memo; the layout (every other field) was walked before, so its compiled record
(`llmem.walk.replay`) evaluates the moments at the new length: the cost of an estimate that is computed."""

import functools
import itertools

import pytest

from llmem.compare import compare
from llmem.estimate import estimate
from llmem.gpus import get_gpu
from llmem.plan import TrainingPlan
from llmem.presets import load_preset
from llmem.spec import ModelSpec

PRESETS = {"llama-3.3-70b": "llama-3.3-70b-instruct",
           "gemma-2-2b": "gemma-2-2b",  # eager attention: the walk's extra moments
           "qwen3-30b-a3b": "qwen3-30b-a3b"}  # an MoE whose tables are traced (`llmem.derive`)


@functools.cache
def spec_of(model: str) -> ModelSpec:
    """One spec per model for the whole module (its memo shared by the tests, as in a running app), built when a
    test first asks: not at collection, where every xdist worker built them all (the traced MoE's ~4 s, for tests
    that run only under -m heavy)."""
    return ModelSpec.from_config(load_preset(PRESETS[model]))

CAPACITY = get_gpu("h100-80gb").memory_bytes
PLANS = {
    "single": {}, "ddp": {"gpus": 8}, "zero1": {"gpus": 8, "zero": 1}, "zero2": {"gpus": 8, "zero": 2},
    "zero3": {"gpus": 8, "zero": 3}, "zero3-ckpt": {"gpus": 8, "zero": 3, "grad_ckpt": "full"},
    "tp": {"gpus": 8, "tp": 2, "zero": 3}, "lora": {"method": "lora"},
    "qlora": {"method": "qlora", "quant": "nf4", "precision": "bf16"},
    "deepspeed2": {"gpus": 8, "zero": 2, "engine": "deepspeed"},
    "deepspeed3": {"gpus": 8, "zero": 3, "engine": "deepspeed"}, "fsdp1": {"gpus": 8, "zero": 3, "engine": "fsdp1"},
    "pp": {"gpus": 4, "pp": 4, "microbatches": 4, "batch_size": 4},
}
REFUSED = {("gemma-2-2b", "pp"), ("qwen3-30b-a3b", "pp")}  # pipeline stages are modelled for dense llama-likes
CASES = [("llama-3.3-70b", name) for name in PLANS] + [("gemma-2-2b", name) for name in PLANS
                                                       if "lora" not in name and ("gemma-2-2b", name) not in REFUSED]


def test_one_estimate(benchmark):
    est = benchmark(estimate, spec_of("llama-3.3-70b"), TrainingPlan(gpus=8, zero=3))
    assert est.peak_bytes > 0


@pytest.mark.parametrize(("model", "name"), CASES)
def test_estimate_with_a_fresh_plan(benchmark, model, name):
    """One estimate per scheme and method, a new plan equal to the first each round: the walk is found in the spec's
    memo (gemma2: no LoRA tables)."""
    spec = spec_of(model)
    estimate(spec, TrainingPlan(**PLANS[name]))  # the spec's structural terms, as in a running app
    est = benchmark.pedantic(estimate, setup=lambda: ((spec, TrainingPlan(**PLANS[name])), {}), rounds=300)
    assert est.peak_bytes > 0


CHANGED = [(model, name) for model in PRESETS for name in PLANS if (model, name) not in REFUSED
           and not (model == "gemma-2-2b" and name == "qlora") and not (model == "qwen3-30b-a3b" and "lora" in name)]
# the traced MoE's tables for a scheme are traced the first time (~20-50 s without the on-disk cache; tests/derive
# traces MoE layers by default) and gemma2's LoRA tables at full size (~90 s): under -m heavy
_HEAVY = [pytest.param(*case, marks=pytest.mark.heavy)
          if case[0] == "qwen3-30b-a3b" or case == ("gemma-2-2b", "lora") else case
          for case in CHANGED]


@pytest.mark.parametrize(("model", "name"), _HEAVY)
def test_estimate_after_an_option_change(benchmark, model, name):
    """Each scheme and method with the sequence length changed every round: every size that reads the micro-batch
    or the sequence length is computed again, from the layout's compiled record (`llmem.walk.replay`)."""
    spec, lengths = spec_of(model), itertools.count(1024)
    estimate(spec, TrainingPlan(**PLANS[name]))
    est = benchmark.pedantic(estimate, setup=lambda: ((spec, TrainingPlan(**PLANS[name], seq_len=next(lengths))), {}),
                             rounds=200)
    assert est.peak_bytes > 0


def test_compare_one_to_sixty_four_gpus(benchmark):
    spec = spec_of("llama-3.3-70b")

    def sweep():
        return [compare(spec, TrainingPlan(gpus=n), CAPACITY) for n in (1, 2, 4, 8, 16, 32, 64)]

    results = benchmark(sweep)
    assert len(results) == 7


def test_parse_config(benchmark):
    config = load_preset("llama-3.1-405b")
    spec = benchmark(ModelSpec.from_config, config)
    assert spec.total_params > 4e11


@pytest.mark.heavy
def test_first_lora_estimate_of_an_architecture_traced_at_full_size(benchmark, tmp_path, monkeypatch):
    """The first LoRA estimate of a bare OPT config (12 layers at full size; no LoRA table: traced from the PEFT
    model, `llmem.derive`) under FSDP2 bf16-mixed, into an empty disk cache: a 3-layer prefix is traced
    (`llmem.derive.depth`), not the 12 layers. One round (the next would read the cache)."""
    monkeypatch.setenv("LLMEM_CACHE_DIR", str(tmp_path))
    est = benchmark.pedantic(lambda: estimate(ModelSpec.from_config({"model_type": "opt"}),
                                              TrainingPlan(method="lora", gpus=8, zero=3)), rounds=1, iterations=1)
    assert est.peak_bytes > 0
