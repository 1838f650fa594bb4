"""Speed of a first (cold) 1–64-GPU strategy table with every row's figures (pytest-benchmark; run with
`pytest tests/benchmarks --benchmark-enable -m "heavy or not heavy"`; in the normal suite each runs once as a smoke
test).

Each round builds a new `ModelSpec` and clears the module-level caches the estimate keeps across specs
(`sharding._LOCAL_NUMEL`, `walk.fsdp._COMPUTE_PLANS`, `activations`' cached tables), then asks the seven compares an
app or `llmem compare` asks for 1 … 64 GPUs and every row's `to_dict` (the CLI's and CSV's columns, the verdict
and the high end of the device total, which replays the program's request stream where `request_stream.replays`:
dense llama-likes). Issue 12's budget is 20 ms; llama-3.3-70b is ~1–1.5 s here (docs/notes/2026-11-28-cold-compare.md:
35 replays of 15–20 ms and 40 layouts' streams). The import of the package is not timed."""

import pytest

from llmem.compare import compare
from llmem.components import activations, sharding
from llmem.gpus import get_gpu
from llmem.plan import TrainingPlan
from llmem.presets import load_preset
from llmem.spec import ModelSpec
from llmem.walk import fsdp

CAPACITY = get_gpu("h100-80gb").memory_bytes
COUNTS = (1, 2, 4, 8, 16, 32, 64)


def _fresh(model: str):
    sharding._LOCAL_NUMEL.clear()
    fsdp._COMPUTE_PLANS.clear()
    for cached in vars(activations).values():
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    return (ModelSpec.from_config(load_preset(model)),), {}


def _table(spec: ModelSpec) -> list[dict]:
    return [r.to_dict() for n in COUNTS for r in compare(spec, TrainingPlan(gpus=n), CAPACITY).rows]


@pytest.mark.parametrize("model", ["llama-3.3-70b-instruct", "mixtral-8x7b"])
def test_first_compare_one_to_sixty_four_gpus_with_every_row_figures(benchmark, model):
    """A dense 70b (its rows' high ends replayed) and an MoE (the category rules: no replay)."""
    rows = benchmark.pedantic(_table, setup=lambda: _fresh(model), rounds=5)
    assert rows and all(r["device_total_high_gib"] >= r["device_total_gib"] for r in rows)
