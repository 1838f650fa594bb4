"""LoRA on 2 processes (DDP, ZeRO-1, FSDP2 ZeRO-2/3): real torchrun (gloo, CPU) runs, estimate within 3 % of the
measured max-over-ranks peak (the multi-rank bar). One launch measures every row."""

from __future__ import annotations

import pytest

from llmem.errors import InputError
from llmem.estimate import estimate
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from tests.test_estimate_multirank import CONFIG, LARGE, LARGE_BASE

TOLERANCE = 0.03
BASE = {"batch_size": 2, "seq_len": 64, "precision": "fp32", "optimizer": "adamw", "optimizer_impl": "forloop",
        "method": "lora", "lora_dropout": 0.0, "gpus": 2}
ROWS = {
    "ddp-fp32": {"zero": 0},
    "ddp-bf16mix-foreach": {"zero": 0, "precision": "bf16-mixed", "optimizer_impl": "foreach"},
    "ddp-bf16": {"zero": 0, "precision": "bf16"},
    "zero1-fp32": {"zero": 1},
    "zero2-fp32": {"zero": 2},
    "zero3-fp32": {"zero": 3},
    "zero3-bf16": {"zero": 3, "precision": "bf16"},  # bf16 base + fp32 adapters: a byte (uint8) all-gather
    "large-ddp-fp32": {"zero": 0, **LARGE_BASE},
    "large-zero1-fp32": {"zero": 1, **LARGE_BASE},
    "large-zero3-fp32": {"zero": 3, **LARGE_BASE},  # the root's all-gather at the start of forward sets the peak
}
_RESULTS: dict = {}


def _config(name: str) -> dict:
    return LARGE if name.startswith("large-") else CONFIG


def measured() -> dict:
    if not _RESULTS:
        from llmem.measure.launch import run_job

        rows = [{"id": n, "config": _config(n), "plan": {**BASE, **ROWS[n]}, "steps": 2} for n in ROWS]
        results, err = run_job(rows, 2, "cpu", timeout=900)
        if not results:
            pytest.fail(f"the 2-process launch measured nothing: {err}")
        _RESULTS.update({r["id"]: r for r in results})
    return _RESULTS


@pytest.mark.parametrize("name", list(ROWS))
def test_lora_two_processes(name):
    plan = TrainingPlan(**{**BASE, **ROWS[name], "device": "cpu"})
    est = estimate(ModelSpec.from_config(_config(name)), plan).peak_bytes
    res = measured()[name]
    assert "error" not in res, res.get("error")
    assert abs(est - res["peak_bytes"]) <= TOLERANCE * res["peak_bytes"], (
        f"{name}: estimate {est:,} not within {TOLERANCE:.0%} of the measured {res['peak_bytes']:,}")


@pytest.mark.parametrize("fields, flag", [
    ({"method": "lora", "gpus": 2, "tp": 2}, "tp"),
    ({"method": "lora", "gpus": 2, "zero": 3, "precision": "bf16-mixed"}, "precision"),
    ({"method": "qlora", "quant": "nf4", "precision": "bf16", "gpus": 2, "zero": 3}, "zero"),  # no FSDP2
])
def test_rejected_multirank_lora(fields, flag):
    with pytest.raises(InputError) as e:
        TrainingPlan(**fields)
    assert e.value.field == flag
