"""`--engine deepspeed`: DeepSpeed 0.19.0's ZeRO-1/2 (`DeepSpeedZeroOptimizer`) and ZeRO-0 (no ZeRO optimizer; bf16:
`FP16_UnfusedOptimizer`) as the HF Trainer builds them, torch AdamW as the client optimizer. Real CPU runs on 2 ranks
(one launch, gloo; DeepSpeed's CPU accelerator): ZeRO-0, ZeRO-1 and ZeRO-2, fp32 and bf16, overlap_comm on and off,
with reduce buckets smaller than the model (several buckets, tensors larger than the bucket reduced in their own
gradient) and at DeepSpeed's default 5e8 elements (one bucket of 2 GB in fp32 / 1 GB in bf16
through backward) — the estimate within 1% of each measured peak. The rows put the peak at each kind of moment:
ZeRO-1's reduce after backward (rank 0 holds its partition gradients beside the gradients not yet moved), the step
(the flat partition gradient and AdamW's temporaries), ZeRO-2's epilogue reduce (the default bucket), and a decoder
layer's backward (the bucket, the partition gradients and the layer's own gradients)."""

from __future__ import annotations

import importlib.util

import pytest

from llmem.components import zero_ds as z
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from llmem.sweep.models import SMALL as SWEEP_MODELS
from tests.components.multirank import TwoRankRows

# found, not imported: importing DeepSpeed takes seconds, and only the launched ranks need it
pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="deepspeed is not installed (scripts/setup.sh installs it)")

LLAMA = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 200, "max_position_embeddings": 256,
         "tie_word_embeddings": False}
GPT2 = {"model_type": "gpt2", "n_embd": 128, "n_layer": 2, "n_head": 4, "vocab_size": 210, "n_positions": 128}
CONFIGS = {"llama": LLAMA, "gpt2": GPT2, "mistral": SWEEP_MODELS["mistral"]}  # mistral: its untied lm_head's
# hook opens the bucket inside the lm_head's backward, the peak there
SMALL = 100_000  # elements: a quarter of the llama's 414,336
CASES = {  # the default suite's launch: each kind of peak moment once, ZeRO-1 and -2, fp32 and bf16
    "llama-z1-fp32": {"zero": 1, "precision": "fp32", "ds_reduce_bucket": SMALL},
    "llama-z2-bf16": {"zero": 2, "precision": "bf16-mixed", "ds_reduce_bucket": SMALL},
    "llama-z2-bf16-default": {"zero": 2, "precision": "bf16-mixed"},
    "gpt2-z2-fp32-seq128": {"zero": 2, "precision": "fp32", "ds_reduce_bucket": 16_384, "seq_len": 128},
    # ZeRO-0 under bf16: FP16_UnfusedOptimizer's step with every fp32 gradient beside the bf16 ones
    "llama-z0-bf16": {"zero": 0, "precision": "bf16-mixed"},
    # overlap_comm: ZeRO-1 reduces in backward's hooks, beside two buckets (the last layer's backward)
    "gpt2-z1-fp32-seq128-overlap": {"zero": 1, "precision": "fp32", "ds_reduce_bucket": 16_384, "seq_len": 128,
                                    "ds_overlap_comm": True},
}
HEAVY = {  # a second launch (-m heavy): the other stage x precision pairs, a default bucket under ZeRO-1, a
    # checkpointed layer's backward with tensors larger than the bucket, SGD's momentum as the client's state
    "llama-z2-fp32": {"zero": 2, "precision": "fp32", "ds_reduce_bucket": SMALL},
    "llama-z1-bf16": {"zero": 1, "precision": "bf16-mixed", "ds_reduce_bucket": SMALL},
    "llama-z1-fp32-default": {"zero": 1, "precision": "fp32"},
    "llama-z2-bf16-seq256-ckpt": {"zero": 2, "precision": "bf16-mixed", "ds_reduce_bucket": 30_000, "seq_len": 256,
                                  "grad_ckpt": "full"},
    "llama-z1-fp32-seq256": {"zero": 1, "precision": "fp32", "ds_reduce_bucket": 30_000, "seq_len": 256},
    "llama-z1-bf16-sgd": {"zero": 1, "precision": "bf16-mixed", "ds_reduce_bucket": SMALL, "optimizer": "sgd"},
    # ZeRO-2 in backward (llmem.walk.deepspeed_hooks): mistral's untied lm_head hook opens the bucket at the peak;
    # llama's MLP moment before the up projection's hook allocates the partition gradients; llama bf16's final norm
    "mistral-z2-fp32-seq64": {"zero": 2, "precision": "fp32", "ds_reduce_bucket": SMALL, "seq_len": 64},
    "llama-z2-fp32-seq256": {"zero": 2, "precision": "fp32", "ds_reduce_bucket": SMALL, "seq_len": 256},
    "llama-z2-bf16-seq256-sgd": {"zero": 2, "precision": "bf16-mixed", "ds_reduce_bucket": SMALL, "seq_len": 256,
                                 "optimizer": "sgd"},
    # ZeRO-0 in fp32 (the engine's all-reduce of the flattened gradients after backward), with SGD, a tied model's
    # and an untied one's, activations at the peak; overlap_comm with both buckets at the peak (the default size:
    # 4 GB in fp32) and with small ones
    "llama-z0-fp32": {"zero": 0, "precision": "fp32"},
    "llama-z0-bf16-sgd": {"zero": 0, "precision": "bf16-mixed", "optimizer": "sgd"},
    "gpt2-z0-bf16-seq128": {"zero": 0, "precision": "bf16-mixed", "seq_len": 128},
    "mistral-z0-fp32-seq64": {"zero": 0, "precision": "fp32", "seq_len": 64},
    "llama-z0-fp32-seq256-ckpt": {"zero": 0, "precision": "fp32", "seq_len": 256, "grad_ckpt": "full"},
    "llama-z2-fp32-overlap": {"zero": 2, "precision": "fp32", "ds_reduce_bucket": SMALL, "ds_overlap_comm": True},
    "llama-z1-bf16-overlap": {"zero": 1, "precision": "bf16-mixed", "ds_reduce_bucket": SMALL,
                              "ds_overlap_comm": True},
    "llama-z1-fp32-overlap-default": {"zero": 1, "precision": "fp32", "ds_overlap_comm": True},
    "llama-z2-bf16-overlap-default": {"zero": 2, "precision": "bf16-mixed", "ds_overlap_comm": True},
    "mistral-z2-bf16-seq64-overlap": {"zero": 2, "precision": "bf16-mixed", "ds_reduce_bucket": SMALL,
                                      "seq_len": 64, "ds_overlap_comm": True},
}
BASE = {"gpus": 2, "batch_size": 1, "seq_len": 16, "engine": "deepspeed"}
# The suite's cover (tests/accuracy) measures this scheme by default; these rows under -m heavy.
ROWS = TwoRankRows(BASE, {**CASES, **HEAVY}, lambda name: CONFIGS[name.split("-", 1)[0]],
                  sampled=())  # the suite measures the DeepSpeed rows by default


@pytest.mark.parametrize("name", ROWS.params())  # HEAVY's rows with -m heavy
def test_deepspeed_estimate_within_1_percent_of_the_real_run(name):
    ROWS.check(name, tolerance=0.01)


def test_partitions_cover_the_flat_parameters_once():
    """The flat layout's own invariants: P_pad divides into W aligned partitions, and every tensor is counted in
    the partition gradients of each rank it touches, whole."""
    for config in CONFIGS.values():
        spec = ModelSpec.from_config(config)
        for gpus in (2, 3, 8):
            plan = TrainingPlan(gpus=gpus, zero=2, engine="deepspeed", ds_reduce_bucket=SMALL)
            numels = z.ordered_numels(spec)
            assert z.flat_numel(spec, plan) % (z.ALIGNMENT * gpus) == 0
            assert 0 <= z.flat_numel(spec, plan) - sum(numels) < z.ALIGNMENT * gpus
            owners = z.owner_ranks(spec, plan)
            for rank in range(gpus):
                assert z.partition_grad_numel(spec, plan, rank) == sum(
                    n for n, ranks in zip(numels, owners, strict=True) if rank in ranks)
            assert sorted(i for b in z.buckets(spec, plan, reverse=True) for i in b) == list(range(len(numels)))


def test_the_simulator_runs_deepspeed():
    """No refusal: `simulate` runs DeepSpeed's engine (tests/simulate/test_simulate_pp_deepspeed.py compares it with
    these rows' real runs)."""
    from llmem.simulate.run import check_simulable

    for zero in (1, 2, 3):
        check_simulable(LLAMA, TrainingPlan(gpus=2, zero=zero, engine="deepspeed"))
