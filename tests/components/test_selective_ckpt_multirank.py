"""`--grad-ckpt selective` on 2 ranks (gloo, CPU, one launch): DDP and FSDP2 ZeRO-3, against the measured
max-over-ranks peak — within 1 % (the single-rank bar; the rows' peaks are the loss backward and the last layer's
backward, where the policy's saved outputs and the outputs the recompute leaves cached both count)."""

from __future__ import annotations

import pytest

from tests.components.multirank import TwoRankRows
from tests.measure.conftest import LLAMA

pytest.importorskip("torch")

BASE = dict(gpus=2, optimizer_impl="forloop", batch_size=4, seq_len=128, grad_ckpt="selective")
ROWS = {
    "ddp-eager-fp32": dict(zero=0, attn="eager", precision="fp32"),
    "fsdp2-sdpa-fp32": dict(zero=3, precision="fp32"),
    "fsdp2-eager-bf16-mixed": dict(zero=3, attn="eager", precision="bf16-mixed"),
}
RUNS = TwoRankRows(BASE, ROWS, lambda _name: dict(LLAMA))


@pytest.mark.parametrize("name", sorted(ROWS))
def test_estimate_matches_two_ranks(name):
    RUNS.check(name, tolerance=0.01)
