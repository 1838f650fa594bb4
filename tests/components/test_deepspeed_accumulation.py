"""`--engine deepspeed --grad-accum K`: DeepSpeed 0.19.0's `gradient_accumulation_steps` with the boundary set before
each backward as accelerate sets it. ZeRO-0/1 reduce only at the boundary (their `.grad`s accumulate whole, ZeRO-1's
bucket open from the first micro-step), ZeRO-2 reduces every micro-step and keeps the earlier partition gradients
beside the next micro-step's, ZeRO-3 adds into its partition-gradient buffer in place. Real CPU runs on 2 ranks, the
estimate within 1% of each peak; the rows put the peak at a later micro-step's moments (long sequences) and at the
step."""

from __future__ import annotations

import importlib.util

import pytest

from tests.components.multirank import TwoRankRows
from tests.components.test_deepspeed import CONFIGS, SMALL
from tests.components.test_deepspeed_zero3 import AUTO

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="deepspeed is not installed (scripts/setup.sh installs it)")

ROWS = TwoRankRows({"gpus": 2, "batch_size": 1, "seq_len": 16, "engine": "deepspeed", "grad_accum": 2}, {
    # the default run's row: micro-step 2's last-layer backward, the partition gradients of micro-step 1 beside it
    "gpt2-z2-fp32-seq128": {"zero": 2, "precision": "fp32", "ds_reduce_bucket": 16_384, "seq_len": 128},
    "llama-z1-fp32-seq256": {"zero": 1, "precision": "fp32", "ds_reduce_bucket": SMALL, "seq_len": 256},
    "llama-z0-bf16-seq256": {"zero": 0, "precision": "bf16-mixed", "seq_len": 256},
    "llama-z3-fp32-auto-seq256": {"zero": 3, "precision": "fp32", **AUTO, "seq_len": 256},
    "llama-z3-fp32-auto": {"zero": 3, "precision": "fp32", **AUTO},
    "llama-z2-bf16": {"zero": 2, "precision": "bf16-mixed", "ds_reduce_bucket": SMALL},
    "llama-z1-fp32": {"zero": 1, "precision": "fp32", "ds_reduce_bucket": SMALL},
    "llama-z0-bf16": {"zero": 0, "precision": "bf16-mixed"},
    # ZeRO-1 under overlap_comm: micro-step 1 keeps ZeRO-1's whole .grads, the boundary's hooks reduce (ZeRO-2's walk
    # with the accumulated .grads not yet moved): the boundary's loss backward, its last layer's MLP moment, the step
    "llama-z1-fp32-overlap-seq256": {"zero": 1, "precision": "fp32", "ds_reduce_bucket": SMALL, "seq_len": 256,
                                     "ds_overlap_comm": True},
    "llama-z1-bf16-overlap-seq256-k3": {"zero": 1, "precision": "bf16-mixed", "ds_reduce_bucket": SMALL,
                                        "seq_len": 256, "ds_overlap_comm": True, "grad_accum": 3},
    "gpt2-z1-fp32-overlap-seq128": {"zero": 1, "precision": "fp32", "ds_reduce_bucket": 16_384, "seq_len": 128,
                                    "ds_overlap_comm": True},
    "llama-z1-bf16-overlap": {"zero": 1, "precision": "bf16-mixed", "ds_reduce_bucket": SMALL,
                              "ds_overlap_comm": True},
    "mistral-z1-fp32-overlap-seq64": {"zero": 1, "precision": "fp32", "ds_reduce_bucket": SMALL, "seq_len": 64,
                                      "ds_overlap_comm": True},
}, lambda name: CONFIGS[name.split("-", 1)[0]], sampled=("gpt2-z2-fp32-seq128",))


@pytest.mark.heavy  # the suite's d2-*-ga2 rows measure it by default (tests/accuracy)
@pytest.mark.parametrize("name", ROWS.params())
def test_deepspeed_accumulation_within_1_percent_of_the_real_run(name):
    ROWS.check(name, tolerance=0.01)


INCREMENT = TwoRankRows({"gpus": 2, "batch_size": 1, "seq_len": 256, "engine": "deepspeed", "zero": 2,
                         "ds_reduce_bucket": SMALL}, {
    "llama-z2-fp32-k1": {"precision": "fp32"}, "llama-z2-fp32-k2": {"precision": "fp32", "grad_accum": 2},
    "llama-z2-bf16-overlap-k1": {"precision": "bf16-mixed", "ds_overlap_comm": True},
    "llama-z2-bf16-overlap-k3": {"precision": "bf16-mixed", "ds_overlap_comm": True, "grad_accum": 3},
}, lambda name: CONFIGS[name.split("-", 1)[0]], sampled=())


@pytest.mark.heavy
@pytest.mark.parametrize("one, more", [("llama-z2-fp32-k1", "llama-z2-fp32-k2"),
                                       ("llama-z2-bf16-overlap-k1", "llama-z2-bf16-overlap-k3")])
def test_zero2_accumulation_adds_exactly_the_earlier_partition_gradients(one, more):
    """Where ZeRO-2's peak is a layer's backward (the gradients freed at their hooks, the partition gradients
    allocated at the up projection's hook, after the MLP's moment: docs/notes/2026-11-27-deepspeed-zero2-hooks.md)
    and, in bf16, the final norm's backward: each row within 1%, and the measured increase from one micro-step to K
    the estimated one within 1%."""
    from llmem.estimate import estimate
    from llmem.spec import ModelSpec

    spec = ModelSpec.from_config(CONFIGS["llama"])
    measured = INCREMENT.measured(one)
    est = [estimate(spec, INCREMENT.plan(n)).peak_bytes for n in (one, more)]
    real = [measured[n]["peak_bytes"] for n in (one, more)]
    assert all(abs(e - r) <= 0.01 * r for e, r in zip(est, real, strict=True)), (est, real)
    assert real[1] > real[0] and abs((est[1] - est[0]) - (real[1] - real[0])) <= 0.01 * (real[1] - real[0])
