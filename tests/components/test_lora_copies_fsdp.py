"""`--lora-modules-to-save` under FSDP2 (`llmem.components.lora_copies_fsdp`): the copies as root-group parameters.

Default: the runtime's own `fully_shard` wrapping of the PEFT model on the meta device in a fake two-rank world
(torch's `fake` process group: no collective runs) — the copies' shards, the root's all-gather output and the
optimizer's tensors as FSDP2 lays them out, against the estimate's terms. Heavy: estimate vs the measured peak of real
two-rank gloo runs, within 1 % (every row measured within 0.01 %: the copies' shard, their states, the root's
gathered copies, the unsharded gradients through the root's reduce-scatter and the embedding copy's backward)."""

from __future__ import annotations

import math

import pytest

from llmem.components import communication as comm
from llmem.components import lora_copies_fsdp as copies
from llmem.components.trained import trained_tensors
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from tests.components.multirank import TwoRankRows
from tests.components.test_activations import CONFIGS

# parameter-dominated (vocab 4000, 16 tokens): the root's gathers, its reduce-scatter and the embedding copy's
# backward set the peak; LLAMA_GQA is the accuracy suite's llama-gqa (vocab 512), where the layers' do
LARGE_VOCAB = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4000, "max_position_embeddings": 256,
               "tie_word_embeddings": False}
LLAMA_GQA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256,
             "tie_word_embeddings": False}


def _root_group(plan: TrainingPlan):
    """The runtime's wrapping of the PEFT model for `plan` on the meta device in a fake world of `plan.gpus` ranks:
    the root group's FSDPParams."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from llmem.runtime.parallel import wrap
    from tests.components.test_lora import peft_model_on_meta

    dist.init_process_group("fake", rank=0, world_size=plan.gpus, store=FakeStore())
    try:
        model = wrap(peft_model_on_meta(CONFIGS["llama"], plan), plan, "cpu")
        return list(model._get_fsdp_state()._fsdp_param_group.fsdp_params)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("plan", [
    TrainingPlan(method="lora", gpus=2, zero=3, precision="fp32", lora_modules_to_save="lm_head,embed_tokens"),
    TrainingPlan(method="lora", gpus=3, zero=2, precision="bf16-mixed", lora_modules_to_save="lm_head"),
], ids=["zero3-fp32-both", "zero2-bf16mix-head-3ranks"])
def test_the_copies_are_root_parameters_as_fully_shard_lays_them_out(plan):
    group = _root_group(plan)
    spec = ModelSpec.from_config(CONFIGS["llama"])
    trained = [fp for fp in group if fp.sharded_param.requires_grad]  # the copies (llama's root has no adapter)
    shard = [math.prod(fp.padded_sharded_param_size) for fp in trained]
    assert copies.sharded_copy_bytes(spec, plan) == sum(shard) * plan.precision.param_bytes
    half = 2 if plan.precision.is_mixed else None  # the MixedPrecisionPolicy's param_dtype, else each one's own
    gathered = sum(math.prod(fp.padded_sharded_param_size) * plan.gpus * (half or fp.sharded_param.element_size())
                   for fp in group)
    assert comm.root_unsharded_bytes(spec, plan) == gathered  # the root's all-gather output: originals and copies
    numel = trained_tensors(spec, plan).numel  # the optimizer's tensors: the embedding copy first, the lm_head last
    assert sorted(n for n in numel if n in shard) == sorted(shard)


ROWS = TwoRankRows(
    {"gpus": 2, "method": "lora", "batch_size": 1, "seq_len": 16},
    {"zero3-bf16mix-both": {"zero": 3, "precision": "bf16-mixed", "lora_modules_to_save": "lm_head,embed_tokens"},
     "zero2-bf16mix-both": {"zero": 2, "precision": "bf16-mixed", "lora_modules_to_save": "lm_head,embed_tokens"},
     "zero2-fp32-both": {"zero": 2, "precision": "fp32", "lora_modules_to_save": "lm_head,embed_tokens"},
     "zero3-fp32-head": {"zero": 3, "precision": "fp32", "lora_modules_to_save": "lm_head"},
     "zero3-bf16-both": {"zero": 3, "precision": "bf16", "lora_modules_to_save": "lm_head,embed_tokens"},
     "zero3-qlora-bf16mix-both": {"zero": 3, "method": "qlora", "quant": "nf4", "precision": "bf16-mixed",
                                  "lora_modules_to_save": "lm_head,embed_tokens"},
     "zero2-keep-bf16mix-both": {"zero": 2, "precision": "bf16-mixed", "keep_grads": True,
                                 "lora_modules_to_save": "lm_head,embed_tokens"},
     "zero3-accum2-fp32-both": {"zero": 3, "precision": "fp32", "grad_accum": 2,
                                "lora_modules_to_save": "lm_head,embed_tokens"},
     "gqa-zero3-fp32-head": {"zero": 3, "precision": "fp32", "lora_modules_to_save": "lm_head", "batch_size": 2,
                             "seq_len": 32},
     "gqa-zero3-bf16mix-ckpt-both": {"zero": 3, "precision": "bf16-mixed", "grad_ckpt": "full",
                                     "lora_modules_to_save": "lm_head,embed_tokens", "batch_size": 2, "seq_len": 32}},
    lambda name: LLAMA_GQA if name.startswith("gqa-") else LARGE_VOCAB, sampled=())


@pytest.mark.heavy
@pytest.mark.parametrize("name", list(ROWS.rows))
def test_estimate_matches_two_rank_fsdp2_with_module_copies(name):
    ROWS.check(name, tolerance=0.01)
