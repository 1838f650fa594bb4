"""Views at micro-batch 1 that keep more (or less) than a copy would. Eager attention behind a fused q/k/v
projection (phi3's qkv_proj, gpt_neox's query_key_value): `at::matmul` reshapes v (a transposed view of the fused
output) to the bmm batch, a view when the micro-batch is 1, so BmmBackward0 keeps the whole fused output where a
micro-batch of 2 keeps a v-sized copy (`llmem.components.saved.attention_saved`, `fused_v_bytes`); gpt2's c_attn
under the CPU math path of sdpa (dropout), whose fp32 v is such a view too; one kv head per rank, whose repeat_kv
is a stride-0 view (`kv_view_bytes`). Estimates against real CPU runs (counting allocator): one rank, and gpt_neox
under ZeRO-3 and qwen2 under TP on two. Found by the random sweep (seed 12: plans 937 and 1122, phi3, -3.1% and
-1.6%; plan 1866, gpt_neox ZeRO-3, -1.7%; plan 1601, qwen2 TP, +1.0%); the suite's rows run micro-batch 2."""

from __future__ import annotations

import pytest

from llmem.estimate import estimate
from llmem.measure.run import measure_rank
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from llmem.sweep.models import models
from tests.components.multirank import TwoRankRows

SMALL = models("small")
CASES = {
    "phi3-fp32-b1": ("phi3", dict(batch_size=1, precision="fp32", grad_accum=2)),
    "phi3-bf16-mixed-b1": ("phi3", dict(batch_size=1, precision="bf16-mixed")),
    "phi3-fp32-b2": ("phi3", dict(batch_size=2, precision="fp32")),
    "neox-fp32-b1": ("gpt_neox", dict(batch_size=1, precision="fp32")),
    "neox-bf16-b1": ("gpt_neox", dict(batch_size=1, precision="bf16", optimizer_impl="forloop")),
    # sdpa with dropout on CPU runs the math path: an fp32 v is not upcast, so its bmm operand is a view of c_attn's
    # output at micro-batch 1 (-1.0% before, checkpointed: the recompute's softmax moment)
    "gpt2-math-sdpa-fp32-b1": ("gpt2", dict(batch_size=1, seq_len=64, precision="fp32", grad_ckpt="full",
                                            attn="sdpa")),
    # one kv head (gemma's multi-query): repeat_kv and matmul's reshape are stride-0 views at micro-batch 1, k and v
    # kept at kv width; under autocast k's half cast of the expanded view is a full-head copy (0.3-0.8% over before)
    "gemma-fp16-b1": ("gemma", dict(batch_size=1, precision="fp16", optimizer="adafactor")),
    "gemma-bf16-mixed-b1": ("gemma", dict(batch_size=1, precision="bf16-mixed", grad_accum=3)),
    "gemma-fp32-b2": ("gemma", dict(batch_size=2, precision="fp32")),
}


@pytest.mark.parametrize("name", CASES)
def test_eager_fused_qkv_within_a_quarter_percent(name):
    """The b1 rows were 1.5-3.1% under the measured peak with v's copy in the table (two query-sized tensors per
    layer of the 2-layer models); the bound is the suite's single-rank spread (its rows are within 0.1%)."""
    model, fields = CASES[name]
    plan = TrainingPlan(**{"seq_len": 128, "attn": "eager", **fields}, device="cpu")
    measured = measure_rank(SMALL[model], plan)["peak_bytes"]
    est = estimate(ModelSpec.from_config(SMALL[model]), plan).peak_bytes
    assert abs(est - measured) <= 0.0025 * measured, f"{est:,} vs {measured:,}"


TWO_RANKS = TwoRankRows({"gpus": 2, "batch_size": 1, "attn": "eager", "precision": "fp32"},
                        {"neox-zero3-b1": {"zero": 3, "seq_len": 32},
                         # TP 2 of qwen2's 2 kv heads: one per rank (sweep seed 12 plan 1601, +1.0% before)
                         "qwen2-tp-b1": {"tp": 2, "seq_len": 128, "optimizer": "sgd", "optimizer_impl": "forloop"}},
                        lambda name: SMALL["gpt_neox" if name.startswith("neox") else "qwen2"])


@pytest.mark.parametrize("name", ["neox-zero3-b1", "qwen2-tp-b1"])
def test_two_ranks_eager_batch1(name):
    TWO_RANKS.check(name, tolerance=0.0025)


@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16-mixed", marks=pytest.mark.heavy)])
def test_pythia_eager_batch1_at_full_size_against_simulate(precision):
    """pythia-160m, 1 × 1024 tokens: the full-size program on fake tensors (`simulate`) and the estimate agree to 0.1%
    (the estimate was 2 · T · q · cb per layer, -1.9%, under it with v's copy in the table)."""
    from llmem.presets import load_preset
    from llmem.simulate import simulate

    config = load_preset("pythia-160m")
    plan = TrainingPlan(precision=precision, attn="eager", seq_len=1024, batch_size=1)
    est = estimate(ModelSpec.from_config(config), plan).peak_bytes
    sim = simulate(config, plan).peak_bytes
    assert abs(est - sim) <= 0.001 * sim, f"{est:,} vs {sim:,}"
