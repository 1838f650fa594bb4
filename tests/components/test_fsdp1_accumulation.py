"""`--engine fsdp1` beyond two ranks and one micro-step: FSDP1 on one GPU (a world of one, which FSDP runs as
NO_SHARD), on four ranks (each sharding strategy), and with gradients kept across micro-steps (`--grad-accum 2`,
every micro-step synced: `_saved_grad_shard` accumulation) or steps (`--keep-grads`). Real CPU runs (gloo), one
launch per process count; the estimate within 1% of each measured peak. The models are test_fsdp1's, wide for their
vocabulary and sequence, so the flat parameters, their gradients and buffers set the peak. Every row is `heavy`
(a launch costs more than the default run's budget per test); the accuracy suite's rows measure the same programs."""

from __future__ import annotations

import pytest

from tests.components.multirank import TwoRankRows
from tests.components.test_fsdp1 import CONFIGS

BASE = {"batch_size": 1, "seq_len": 16, "engine": "fsdp1", "precision": "fp32"}  # the plan default is bf16-mixed


def _config(name: str) -> dict:
    return CONFIGS[name.split("-", 1)[0]]


ACCUM = TwoRankRows({**BASE, "gpus": 2}, {
    "llama-z3-fp32-accum2": {"zero": 3, "grad_accum": 2},
    "llama-z3-bf16-keep": {"zero": 3, "precision": "bf16-mixed", "keep_grads": True},
    "llama-z2-bf16-accum2": {"zero": 2, "precision": "bf16-mixed", "grad_accum": 2},
    "llama-z2-fp32-ckpt-keep": {"zero": 2, "grad_ckpt": "full", "keep_grads": True},
    "llama-z0-fp32-keep": {"zero": 0, "keep_grads": True},
    "llama-z0-bf16-accum2": {"zero": 0, "precision": "bf16-mixed", "grad_accum": 2},
    "gpt2-z3-bf16-ckpt-accum2": {"zero": 3, "precision": "bf16-mixed", "grad_ckpt": "full", "grad_accum": 2},
}, _config, sampled=())

FOUR = TwoRankRows({**BASE, "gpus": 4}, {
    "llama-z3-fp32": {"zero": 3},
    "llama-z2-bf16": {"zero": 2, "precision": "bf16-mixed"},
    "llama-z0-fp32": {"zero": 0},
    "gpt2-z3-bf16-ckpt": {"zero": 3, "precision": "bf16-mixed", "grad_ckpt": "full"},
    "llama-z3-bf16-accum2": {"zero": 3, "precision": "bf16-mixed", "grad_accum": 2},
}, _config, sampled=())

ONE = TwoRankRows({**BASE, "gpus": 1}, {
    "llama-fp32": {},
    "llama-bf16": {"precision": "bf16-mixed"},
    "gpt2-bf16-ckpt": {"precision": "bf16-mixed", "grad_ckpt": "full"},
    "llama-fp32-accum2": {"grad_accum": 2},
}, _config, sampled=())


@pytest.mark.parametrize("name", ACCUM.params())
def test_fsdp1_kept_gradients_within_1_percent_of_the_real_run(name):
    ACCUM.check(name, tolerance=0.01)


@pytest.mark.parametrize("name", FOUR.params())
def test_fsdp1_on_four_ranks_within_1_percent_of_the_real_run(name):
    FOUR.check(name, tolerance=0.01)


@pytest.mark.parametrize("name", ONE.params())
def test_fsdp1_on_one_gpu_within_1_percent_of_the_real_run(name):
    ONE.check(name, tolerance=0.01)
