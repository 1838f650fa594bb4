"""`--engine fsdp1 --method qlora`: the 4-bit base as FSDP-QLoRA recipes store it (bnb_4bit_quant_storage = the
pure bf16 base's dtype, the adapters in it too: --lora-adapter-dtype base), flattened by FullyShardedDataParallel with
each decoder layer's norms and adapters. The codes' size against bitsandbytes' own quantization, the flat layout
against FSDP1's own FlatParameters, and real CPU runs on 2 ranks (under -m heavy; the suite's cover measures the
scheme by default): llama, qwen3 and gemma; FULL_SHARD and NO_SHARD, nf4 and fp4, with and without double
quantization and checkpointing, gradients kept across micro-steps or steps; the estimate within 1 % of each measured
peak."""

from __future__ import annotations

import pytest

from llmem.components import flat_param as fp
from llmem.components import flat_qlora
from llmem.errors import InputError
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec, ParamTensor
from llmem.sweep.models import SMALL
from tests.components.multirank import TwoRankRows
from tests.components.test_fsdp1 import LLAMA

CONFIGS = {name: SMALL[name] for name in ("qwen3", "gemma")}  # per-head norms; (1 + weight) norms, tied
BASE = {"gpus": 2, "batch_size": 1, "seq_len": 16, "engine": "fsdp1", "method": "qlora", "quant": "nf4",
        "precision": "bf16", "lora_adapter_dtype": "base"}
WIDE = {"batch_size": 1, "seq_len": 256}  # activations outweigh the flat parameters
ROWS = TwoRankRows(BASE, {
    "z3-none": {"zero": 3},
    "z3-full-dq": {"zero": 3, "grad_ckpt": "full", "double_quant": True},
    "z3-none-fp4-wide": {"zero": 3, "quant": "fp4", **WIDE},
    "z3-full-q,v-wide": {"zero": 3, "grad_ckpt": "full", "lora_targets": "q_proj,v_proj", **WIDE},
    "z0-none-dq": {"zero": 0, "double_quant": True},
    "z0-full-wide": {"zero": 0, "grad_ckpt": "full", **WIDE},
    "z3-none-accum2": {"zero": 3, "grad_accum": 2},  # every unit's shard (codes' zeros included) kept
    "z0-none-keep": {"zero": 0, "keep_grads": True},
    "qwen3-z3-none": {"zero": 3},  # per-head q/k norms in the layer's unit
    "qwen3-z3-none-wide": {"zero": 3, **WIDE},
    "gemma-z3-full-wide": {"zero": 3, "grad_ckpt": "full", **WIDE},  # (1 + weight) norms, tied embeddings
}, lambda name: CONFIGS.get(name.split("-", 1)[0], LLAMA), sampled=())


@pytest.mark.parametrize("name", ROWS.params())
def test_fsdp1_qlora_within_1_percent_of_the_real_run(name):
    ROWS.check(name, tolerance=0.01)


def test_packed_codes_are_what_bitsandbytes_stores():
    """bitsandbytes' own quantization with quant_storage=bf16: the packed codes' shape is `packed_param`'s."""
    import bitsandbytes as bnb
    import torch

    plan = TrainingPlan(**{**BASE, "zero": 3})
    for shape in ((128, 344), (64, 128), (344, 128)):
        codes, _ = bnb.functional.quantize_4bit(torch.ones(shape, dtype=torch.bfloat16), quant_type="nf4",
                                                quant_storage=torch.bfloat16)
        assert codes.dtype == torch.bfloat16
        assert tuple(codes.shape) == flat_qlora.packed_param(ParamTensor("w", shape), plan).shape


def test_flat_layout_is_fsdp1s(monkeypatch):
    """The FlatParameters FSDP1 builds over the 4-bit model (a process group of one: NO_SHARD, whole units) hold the
    numels `flat_param.units` gives, root first. The group and the launcher variables it sets are undone after."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from llmem.runtime.session import prepare

    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.setenv(key, "1" if key == "WORLD_SIZE" else "0")
    plan = TrainingPlan(**{**BASE, "gpus": 1, "zero": 0, "device": "cpu"})
    created = not dist.is_initialized()
    try:
        session = prepare(LLAMA, plan)
        real = [m._handle.flat_param.numel() for m in FSDP.fsdp_modules(session.model) if m._handle is not None]
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()
    expected = [u.numel for u in fp.units(ModelSpec.from_config(LLAMA), plan)]
    assert sorted(real) == sorted(expected) and len(real) == 1 + LLAMA["num_hidden_layers"]


@pytest.mark.parametrize("fields, blame", [
    ({"lora_adapter_dtype": "fp32"}, "lora-adapter-dtype"),  # PEFT's fp32 adapters beside bf16 codes
    ({"zero": 2}, "zero"),  # SHARD_GRAD_OP's writeback check against Linear4bit's re-registered weight
    ({"precision": "bf16-mixed", "lora_adapter_dtype": "fp32"}, "engine"),  # codes in fp32 storage: a gap
    ({"quant": "int8"}, "engine"),  # int8 codes cannot be flattened
])
def test_fsdp1_qlora_refusals(fields, blame):
    with pytest.raises(InputError) as e:
        TrainingPlan(**{**BASE, "zero": 3, **fields})
    assert e.value.field == blame
