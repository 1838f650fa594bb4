"""`--engine fsdp1 --method lora`: PEFT's LoRA model wrapped by FullyShardedDataParallel as for full fine-tuning
(one FlatParameter per decoder layer holding its frozen base and its adapters, one for the frozen root). Real CPU runs
on 2 ranks, the estimate within 1% of each measured peak: FULL_SHARD (--zero 3) and SHARD_GRAD_OP (--zero 2), fp32
and bf16 MixedPrecision, with and without full checkpointing, q_proj,v_proj and all-linear targets. The default
launch takes the two LoRA-only moments that set a peak (down_proj's lora_A backward under checkpointing, the frozen
final norm's backward); the heavy launch the rest of the grid (a layer's flat gradient sets most of its peaks),
NO_SHARD, eager attention and --ckpt-every 2."""

from __future__ import annotations

import pytest

from llmem.errors import InputError
from llmem.estimate import estimate
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from tests.components.multirank import TwoRankRows
from tests.components.test_fsdp1 import GPT2, LLAMA

LLAMA3 = {**LLAMA, "num_hidden_layers": 3}
BASE = {"gpus": 2, "batch_size": 1, "seq_len": 16, "engine": "fsdp1", "method": "lora", "lora_targets": "q_proj,v_proj"}
WIDE = {"batch_size": 1, "seq_len": 128}  # activations outweigh the flat parameters
DEFAULT = {
    # down_proj's adapter branch runs its backward before the base Linear's (checkpointed: after the recompute)
    "z3-fp32-full-all-wide": {"zero": 3, "precision": "fp32", "grad_ckpt": "full", "lora_targets": "all-linear",
                              **WIDE},
    # the frozen final norm's backward: pow_backward's fp32 temporaries
    "z2-bf16-mixed-none-all-wide": {"zero": 2, "precision": "bf16-mixed", "lora_targets": "all-linear", **WIDE},
}
HEAVY = {f"z{z}-{prec}-{ckpt}": {"zero": z, "precision": prec, "grad_ckpt": ckpt}
         for z in (2, 3) for prec in ("fp32", "bf16-mixed") for ckpt in ("none", "full")}
HEAVY = {k: v for k, v in HEAVY.items() if k not in DEFAULT} | {
    "z3-fp32-none-all": {"zero": 3, "precision": "fp32", "lora_targets": "all-linear"},
    "z3-fp32-none-drop0": {"zero": 3, "precision": "fp32", "lora_dropout": 0.0},
    "z3-fp32-none-wide": {"zero": 3, "precision": "fp32", **WIDE},
    "z3-fp32-none-eager": {"zero": 3, "precision": "fp32", "attn": "eager"},
    "z0-fp32-none": {"zero": 0, "precision": "fp32"},
    "z0-bf16-mixed-full": {"zero": 0, "precision": "bf16-mixed", "grad_ckpt": "full"},
    "z0-fp32-full-all-wide": {"zero": 0, "precision": "fp32", "grad_ckpt": "full", "lora_targets": "all-linear",
                              **WIDE},
    "llama3-z3-fp32-every2": {"zero": 3, "precision": "fp32", "grad_ckpt": "full", "ckpt_every": 2},
    "llama3-z3-bf16-mixed-none-wide": {"zero": 3, "precision": "bf16-mixed", **WIDE},
}


def _config(name: str) -> dict:
    return LLAMA3 if name.startswith("llama3") else LLAMA


# The suite's cover (tests/accuracy) measures this scheme by default; these rows under -m heavy.
ROWS = TwoRankRows(BASE, {**DEFAULT, **HEAVY}, _config, sampled=())


@pytest.mark.parametrize("name", ROWS.params())  # HEAVY's grid with -m heavy
def test_fsdp1_lora_within_1_percent_of_the_real_run(name):
    ROWS.check(name, tolerance=0.01)


@pytest.mark.parametrize("fields, blame", [
    ({"precision": "bf16"}, "precision"),  # PEFT's fp32 adapters beside a bf16 base: two dtypes in one unit
    ({"method": "qlora", "quant": "nf4", "precision": "bf16"}, "lora-adapter-dtype"),  # fp32 adapters, bf16 codes
    ({"lora_modules_to_save": "lm_head"}, "lora-modules-to-save"),
])
def test_fsdp1_lora_refusals(fields, blame):
    with pytest.raises(InputError) as e:
        TrainingPlan(**{**BASE, "zero": 3, **fields})
    assert e.value.field == blame


def test_traced_lora_tables_are_a_gap_under_fsdp1():
    with pytest.raises(InputError) as e:
        estimate(ModelSpec.from_config(GPT2), TrainingPlan(**{**BASE, "zero": 3, "precision": "fp32",
                                                                         "lora_targets": "c_attn"}))
    assert e.value.field == "engine"


def test_tied_no_shard_is_refused_where_the_real_run_stops(monkeypatch):
    """LoRA on tied embeddings under FSDP1 NO_SHARD without MixedPrecision: the real program (a process group of
    one, in this process) stops in the second step's forward with torch's assertion, and the estimate refuses it, naming
    --zero; under bf16 MixedPrecision both run."""
    import torch.distributed as dist

    from llmem.runtime.session import prepare, train_step

    tied = {**LLAMA, "tie_word_embeddings": True}
    plan = TrainingPlan(**{**BASE, "gpus": 1, "zero": 0, "precision": "fp32", "device": "cpu"})
    with pytest.raises(InputError) as e:
        estimate(ModelSpec.from_config(tied), plan)
    assert e.value.field == "zero"
    estimate(ModelSpec.from_config(tied), plan.with_(precision="bf16-mixed"))
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.setenv(key, "1" if key == "WORLD_SIZE" else "0")
    created = not dist.is_initialized()
    try:
        with pytest.raises(AssertionError, match="as_params=True"):
            session = prepare(tied, plan)
            train_step(session)  # (the first step runs)
            train_step(session)
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()
