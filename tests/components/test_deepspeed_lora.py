"""`--engine deepspeed --method lora` (fp32, ZeRO-0/1/2; ZeRO-2 and overlap_comm with --lora-dropout 0): the PEFT
model passed to `deepspeed.initialize` with a torch AdamW/SGD over its trainable parameters, as the HF Trainer does;
DeepSpeed 0.19.0's ZeRO optimizer flattens, partitions and reduces only the adapters (`llmem.components.ds_lora`),
the frozen base stays the module's. Real CPU runs on 2 ranks (gloo, DeepSpeed's CPU accelerator), the estimate
within 1% of each measured peak: the adapters' flat buffer, master and states, ZeRO-1's bucket (DeepSpeed's 2 GB
default and a small one) and its reduce after backward, ZeRO-0's all-reduce of the adapters' gradients, ZeRO-2's
(and overlap_comm's) reduces in the adapters' hooks (the partition gradients before the MLP moment, the down_proj
adapters' gradients already in the bucket)."""

from __future__ import annotations

import importlib.util

import pytest

from llmem.components import ds_lora, lora
from llmem.components import zero_ds as z
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from tests.components.multirank import TwoRankRows
from tests.components.test_deepspeed import CONFIGS

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="deepspeed is not installed (scripts/setup.sh installs it)")

# The suite's cover (tests/accuracy) measures this scheme by default; these rows under -m heavy.
ROWS = TwoRankRows({"gpus": 2, "batch_size": 1, "engine": "deepspeed", "method": "lora", "precision": "fp32"}, {
    "mistral-z1-all-s64": {"zero": 1, "seq_len": 64, "ds_reduce_bucket": 4096, "lora_targets": "all-linear"},
    "llama-z1-s256": {"zero": 1, "seq_len": 256, "ds_reduce_bucket": 4096},
    "llama-z0-s256": {"zero": 0, "seq_len": 256},
    "llama-z1-all-r16-default-bucket": {"zero": 1, "seq_len": 16, "lora_targets": "all-linear", "lora_rank": 16},
    "llama-z0-s16-sgd": {"zero": 0, "seq_len": 16, "optimizer": "sgd"},
    # checkpointed: the embeddings' output leaf and its .grad held through the step (the peak at 16 tokens)
    "llama-z0-s16-ckpt": {"zero": 0, "seq_len": 16, "grad_ckpt": "full"},
    # gradient accumulation: the adapters' .grads whole between micro-steps, ZeRO-1's bucket open from micro-step 1
    "llama-z1-ga2-s256": {"zero": 1, "seq_len": 256, "ds_reduce_bucket": 4096, "grad_accum": 2},
    "mistral-z0-all-ga2-s64": {"zero": 0, "seq_len": 64, "lora_targets": "all-linear", "grad_accum": 2},
    "mistral-z1-all-ga3-s64": {"zero": 1, "seq_len": 64, "ds_reduce_bucket": 4096, "lora_targets": "all-linear",
                               "grad_accum": 3},
    # ZeRO-2 and ZeRO-1 overlap_comm (`--lora-dropout 0`): the hooks reduce inside the LoRA layers; the peak is the
    # MLP moment after down_proj's adapter hooks, the partition gradients allocated there (llama), or the loss
    "llama-z1-ov-s16-d0": {"zero": 1, "seq_len": 16, "ds_reduce_bucket": 4096, "ds_overlap_comm": True,
                           "lora_dropout": 0.0},
    "llama-z2-s256-d0": {"zero": 2, "seq_len": 256, "ds_reduce_bucket": 4096, "lora_dropout": 0.0},
    "gpt2-z2-s128-d0": {"zero": 2, "seq_len": 128, "ds_reduce_bucket": 4096, "lora_dropout": 0.0},
    "llama-z2-ga2-s256-d0": {"zero": 2, "seq_len": 256, "ds_reduce_bucket": 4096, "lora_dropout": 0.0,
                             "grad_accum": 2},
    "llama-z1-ov-ga2-s256-d0": {"zero": 1, "seq_len": 256, "ds_reduce_bucket": 4096, "lora_dropout": 0.0,
                                "grad_accum": 2, "ds_overlap_comm": True},
    "llama-z2-s256-qv-d0": {"zero": 2, "seq_len": 256, "ds_reduce_bucket": 4096, "lora_targets": "q_proj,v_proj",
                            "lora_dropout": 0.0},
    "llama-z2-s16-d0-default": {"zero": 2, "seq_len": 16, "lora_dropout": 0.0},
    "mistral-z2-all-s64-d0-ov": {"zero": 2, "seq_len": 64, "ds_reduce_bucket": 4096, "lora_targets": "all-linear",
                                 "lora_dropout": 0.0, "ds_overlap_comm": True},
    # PEFT's dropout (0.05): the peak inside the last layer's down_proj adapter (`lora_forward`), the MLP moment
    # with the dropout's saves freed by its backward (docs/notes/2026-11-27-lora-dropout-forward.md)
    "llama-z2-s256": {"zero": 2, "seq_len": 256, "ds_reduce_bucket": 4096},
    "llama-z1-ov-s16": {"zero": 1, "seq_len": 16, "ds_reduce_bucket": 4096, "ds_overlap_comm": True},
}, lambda name: CONFIGS[name.split("-", 1)[0]], sampled=())


@pytest.mark.parametrize("name", ROWS.params())
def test_deepspeed_lora_within_1_percent_of_the_real_run(name):
    ROWS.check(name, tolerance=0.01)


def test_only_the_adapters_are_flattened():
    """The flat buffer holds PEFT's adapters (their count, padded to 2 W), never the frozen base."""
    spec = ModelSpec.from_config(CONFIGS["llama"])
    plan = TrainingPlan(gpus=2, zero=1, engine="deepspeed", method="lora", precision="fp32")
    view = ds_lora.trainable_spec(spec, plan)
    adapters = sum(p.numel for p in lora.adapter_params(spec, plan))
    assert sum(z.ordered_numels(view)) == adapters < spec.total_params
    assert 0 <= z.flat_numel(view, plan) - adapters < z.ALIGNMENT * plan.dp


def test_zero2_lora_on_experts_is_a_gap():
    """ZeRO-2 / overlap_comm LoRA is measured on dense models; on mixtral's experts it read +1.86% (the MLP-moment
    bound), so the estimate names the gap instead of answering; ZeRO-1 without overlap_comm stays modelled."""
    from llmem.errors import InputError
    from llmem.estimate import estimate
    from llmem.sweep.models import SMALL as MODELS

    spec = ModelSpec.from_config(MODELS["mixtral"])
    base = {"gpus": 2, "engine": "deepspeed", "method": "lora", "precision": "fp32", "lora_dropout": 0.0,
            "batch_size": 1, "seq_len": 16, "device": "cpu"}
    with pytest.raises(InputError) as e:
        estimate(spec, TrainingPlan(**base, zero=2))
    assert e.value.gap and e.value.field == "engine"
    assert estimate(spec, TrainingPlan(**base, zero=1)).peak_bytes > 0


def test_zero2_lora_dropout_is_modelled_where_measured():
    """With PEFT's dropout, ZeRO-2 LoRA is measured on llama (gated MLP, down_proj adapted: `lora_forward`, the rows
    llama-z2-s256 / llama-z1-ov-s16 above); a plan whose down_proj is not adapted, or gpt2's MLP, stays a gap."""
    from llmem.errors import InputError
    from llmem.estimate import estimate

    base = {"gpus": 2, "engine": "deepspeed", "method": "lora", "precision": "fp32", "zero": 2, "batch_size": 1,
            "seq_len": 16, "device": "cpu"}
    llama, gpt2 = ModelSpec.from_config(CONFIGS["llama"]), ModelSpec.from_config(CONFIGS["gpt2"])
    assert estimate(llama, TrainingPlan(**base)).peak_bytes > 0
    for spec, extra in ((llama, {"lora_targets": "q_proj,v_proj"}), (gpt2, {})):
        with pytest.raises(InputError) as e:
            estimate(spec, TrainingPlan(**base, **extra))
        assert e.value.gap and e.value.field == "lora-dropout"
