"""`--engine fsdp1`: PyTorch's FullyShardedDataParallel as accelerate configures it (one FlatParameter per decoder
layer and one for the root, use_orig_params, limit_all_gathers, BACKWARD_PRE). Real CPU runs on 2 ranks (one
launch): FULL_SHARD (--zero 3) and SHARD_GRAD_OP (--zero 2), fp32 and bf16 MixedPrecision, with and without full
checkpointing, llama (every combination) and gpt2 (each strategy and precision once), and NO_SHARD (--zero 0) on
both — the estimate within 1% of each measured peak. The models are wide for their vocabulary and sequence, so the
flat parameters, their gradients and buffers (not the logits) set the peak."""

from __future__ import annotations

import pytest

from llmem.components import flat_param as fp
from llmem.estimate import estimate
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from tests.components.multirank import TwoRankRows

LLAMA = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 200, "max_position_embeddings": 256,
         "tie_word_embeddings": False}
GPT2 = {"model_type": "gpt2", "n_embd": 128, "n_layer": 2, "n_head": 4, "vocab_size": 210, "n_positions": 64}
CONFIGS = {"llama": LLAMA, "gpt2": GPT2}
CASES = [("llama", z, prec, ckpt) for z in (2, 3) for prec in ("fp32", "bf16-mixed") for ckpt in ("none", "full")]
CASES += [("gpt2", 2, "bf16-mixed", "full"), ("gpt2", 3, "fp32", "none"),  # gpt2: each strategy and precision once
          ("llama", 0, "fp32", "none"), ("gpt2", 0, "bf16-mixed", "full")]  # NO_SHARD (--zero 0)
# The suite's cover (tests/accuracy) measures this scheme by default; these rows under -m heavy.
ROWS = TwoRankRows(
    {"gpus": 2, "batch_size": 1, "seq_len": 16, "engine": "fsdp1"},
    {f"{m}-z{z}-{prec}-{ckpt}": {"zero": z, "precision": prec, "grad_ckpt": ckpt} for m, z, prec, ckpt in CASES},
    lambda name: CONFIGS[name.split("-", 1)[0]], sampled=())


@pytest.mark.parametrize("model,zero,precision,ckpt", CASES)
def test_fsdp1_estimate_within_1_percent_of_the_real_run(model, zero, precision, ckpt):
    ROWS.check(f"{model}-z{zero}-{precision}-{ckpt}", tolerance=0.01)


def test_flat_units_are_padded_to_the_world_size_and_aligned():
    """The flat layout's own invariants: every tensor starts 16-byte aligned, N divides by the ranks, the shards
    cover each tensor exactly once."""
    for config in CONFIGS.values():
        spec = ModelSpec.from_config(config)
        for precision in ("fp32", "bf16-mixed"):
            plan = TrainingPlan(gpus=2, zero=3, engine="fsdp1", precision=precision)
            for unit in fp.units(spec, plan):
                assert unit.numel % plan.dp == 0
                assert all(off * fp.gather_bytes(plan) % fp.ALIGNMENT_BYTES == 0 for off, _ in unit.params)
                held = [sum(col) for col in zip(*(unit.in_shard(r, plan.dp) for r in range(plan.dp)), strict=True)]
                assert held == [n for _, n in unit.params]


def test_fsdp1_is_not_the_fsdp2_estimate():
    """The engine changes the program: under bf16 MixedPrecision FSDP1's flat gradient and half reduce-scatter
    differ from FSDP2's per-tensor buffers, so the two estimates of one plan differ."""
    spec = ModelSpec.from_config(LLAMA)
    plan = TrainingPlan(gpus=2, zero=3, engine="fsdp1", precision="bf16-mixed", batch_size=1, seq_len=16,
                        device="cpu")
    assert estimate(spec, plan).peak_bytes != estimate(spec, plan.with_(engine="torch")).peak_bytes
