"""`--engine deepspeed --zero 3`: DeepSpeed 0.19.0's `DeepSpeedZeroOptimizer_Stage3` as the HF Trainer builds it, torch
AdamW as the client optimizer. Real CPU runs on 2 ranks (one launch, gloo; DeepSpeed's CPU accelerator), fp32 and
bf16, overlap_comm on and off, at the Trainer's "auto" sizes for this llama (reduce bucket hidden², prefetch
0.9 hidden², persistence threshold 10 hidden: the norms persist, every matrix is gathered) and at DeepSpeed's own
defaults (threshold 1e5: every tensor of this llama persists) — the estimate within 1% of each measured peak; four
ranks under -m heavy."""

from __future__ import annotations

import importlib.util

import pytest

from llmem.components import zero3_ds as z3
from llmem.components import zero_ds as z
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from tests.components.multirank import TwoRankRows
from tests.components.test_deepspeed import CONFIGS

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="deepspeed is not installed (scripts/setup.sh installs it)")

HIDDEN = 128
AUTO = {"ds_reduce_bucket": HIDDEN ** 2, "ds_prefetch_bucket": int(0.9 * HIDDEN ** 2),
        "ds_persistence_threshold": 10 * HIDDEN}  # transformers/integrations/deepspeed.py:232-241
CASES = {  # the default suite's launch
    "llama-z3-fp32-auto": {"precision": "fp32", **AUTO},
    "llama-z3-bf16-auto-overlap": {"precision": "bf16-mixed", **AUTO, "ds_overlap_comm": True},
    "llama-z3-fp32-persist": {"precision": "fp32", "ds_reduce_bucket": 100_000},
}
HEAVY = {  # -m heavy: overlap in fp32, DeepSpeed's default 5e8 bucket, longer sequences (activations at the peak)
    "llama-z3-bf16-auto": {"precision": "bf16-mixed", **AUTO},
    "llama-z3-fp32-auto-overlap": {"precision": "fp32", **AUTO, "ds_overlap_comm": True},
    "llama-z3-bf16-default": {"precision": "bf16-mixed"},
    "llama-z3-fp32-auto-seq256": {"precision": "fp32", **AUTO, "seq_len": 256},
    "llama-z3-bf16-auto-seq256": {"precision": "bf16-mixed", **AUTO, "seq_len": 256},
    "gpt2-z3-fp32-auto-seq128": {"precision": "fp32", **AUTO, "seq_len": 128},
    "llama-z3-bf16-auto-sgd": {"precision": "bf16-mixed", **AUTO, "optimizer": "sgd"},
    "llama-z3-fp32-auto-seq256-ckpt": {"precision": "fp32", **AUTO, "seq_len": 256, "grad_ckpt": "full"},
    "mistral-z3-bf16-auto-seq64": {"precision": "bf16-mixed", **AUTO, "seq_len": 64},
}
BASE = {"gpus": 2, "batch_size": 1, "seq_len": 16, "engine": "deepspeed", "zero": 3}
# The suite's cover (tests/accuracy) measures this scheme by default; these rows under -m heavy.
ROWS = TwoRankRows(BASE, {**CASES, **HEAVY}, lambda name: CONFIGS[name.split("-", 1)[0]],
                  sampled=())  # the suite measures the DeepSpeed rows by default


@pytest.mark.parametrize("name", ROWS.params())  # HEAVY's rows with -m heavy
def test_deepspeed_zero3_estimate_within_1_percent_of_the_real_run(name):
    ROWS.check(name, tolerance=0.01)


FOUR = TwoRankRows({**BASE, "gpus": 4}, {  # -m heavy: four ranks (a quarter of each tensor per rank)
    "llama-z3-fp32-auto": {"precision": "fp32", **AUTO},
    "llama-z3-bf16-auto": {"precision": "bf16-mixed", **AUTO},
    "gpt2-z3-fp32-auto-seq128": {"precision": "fp32", **AUTO, "seq_len": 128},
}, lambda name: CONFIGS[name.split("-", 1)[0]], sampled=())


@pytest.mark.parametrize("name", FOUR.params())
def test_deepspeed_zero3_on_four_ranks_within_1_percent_of_the_real_run(name):
    FOUR.check(name, tolerance=0.01)


def test_each_tensor_is_split_evenly_and_persistence_follows_the_threshold():
    """A tensor of n elements: ceil(n / W) on every rank, W partitions covering it with less than W of padding;
    the persistent ones are those of at most the threshold's elements."""
    spec = ModelSpec.from_config(CONFIGS["llama"])
    for gpus in (2, 3, 8):
        plan = TrainingPlan(gpus=gpus, zero=3, engine="deepspeed", precision="fp32", ds_persistence_threshold=1280)
        total = sum(z.ordered_numels(spec))
        assert 0 <= z3.partition_sum(spec, plan) * gpus - total < gpus * len(z.ordered_numels(spec))
        assert z3.persistent_param_bytes(spec, plan) == 4 * 128 * (2 * spec.num_layers + 1)  # the norms


def test_a_reduce_at_up_proj_s_hook_holds_no_gathered_down_proj():
    """ZeRO-3 releases each module once its input's gradient is made (parameter_offload.py:454-457): at a layer's
    up_proj hook its down_proj's gathered weight is gone, the layer's other modules still gathered; at the next
    layer's first hook the whole later layer is gone (4 ranks, fp32: the 4-rank row's peak)."""
    from llmem.walk.deepspeed3 import _released_at_hooks
    from llmem.walk.deepspeed_hooks import _param_names

    spec = ModelSpec.from_config(CONFIGS["llama"])
    plan = TrainingPlan(gpus=4, zero=3, engine="deepspeed", precision="fp32", **AUTO)
    names = _param_names(spec)
    index = {n: i for i, n in enumerate(names)}
    released = _released_at_hooks(spec, plan)
    inter = CONFIGS["llama"]["intermediate_size"] * HIDDEN  # 44,032: a multiple of 4, no padding
    head = CONFIGS["llama"]["vocab_size"] * HIDDEN  # the untied lm_head, released after its backward
    assert released[index["model.layers.1.mlp.down_proj.weight"]] == head * 4
    assert released[index["model.layers.1.mlp.up_proj.weight"]] == (head + inter) * 4
    assert released[index["model.layers.1.mlp.gate_proj.weight"]] == (head + 2 * inter) * 4
    layer = sum(p.numel for p in spec.layer_params(1) if p.numel > plan.ds_persistence_threshold)
    assert released[index["model.layers.0.mlp.down_proj.weight"]] == (head + layer) * 4
