"""LoRA on 2 processes (DDP, ZeRO-1, FSDP2 ZeRO-2/3): real torchrun (gloo, CPU) runs, estimate within 3 % of the
measured max-over-ranks peak (the multi-rank bar). One launch measures every second row; -m heavy the others."""

from __future__ import annotations

import pytest

from llmem.errors import InputError
from llmem.plan import TrainingPlan
from tests.components.multirank import TwoRankRows
from tests.test_estimate_multirank import CONFIG, LARGE, LARGE_BASE

BASE = {"batch_size": 2, "seq_len": 64, "precision": "fp32", "optimizer": "adamw", "optimizer_impl": "forloop",
        "method": "lora", "lora_dropout": 0.0, "gpus": 2}
ROWS = {
    "ddp-fp32": {"zero": 0},
    "ddp-bf16mix-foreach": {"zero": 0, "precision": "bf16-mixed", "optimizer_impl": "foreach"},
    "ddp-bf16": {"zero": 0, "precision": "bf16"},
    "zero1-fp32": {"zero": 1},
    "zero2-fp32": {"zero": 2},
    "zero3-fp32": {"zero": 3},
    "zero3-bf16": {"zero": 3, "precision": "bf16"},  # bf16 base + fp32 adapters: a byte (uint8) all-gather
    "large-ddp-fp32": {"zero": 0, **LARGE_BASE},
    "large-zero1-fp32": {"zero": 1, **LARGE_BASE},
    "large-zero3-fp32": {"zero": 3, **LARGE_BASE},  # layer 0's all-gather at the start of forward sets the peak
    # FSDP2 with a MixedPrecisionPolicy: base and adapters all-gathered in the half dtype, adapters computing in it
    # (modelling them as fp32 adapters put these rows 20 % high)
    "zero3-bf16mix": {"zero": 3, "precision": "bf16-mixed"},
    "zero2-fp16mix-dropout": {"zero": 2, "precision": "fp16-mixed", "lora_dropout": 0.1},
    # the root's re-gather in its pre-backward (ZeRO-3 reshards the root after forward) sets the peak: its flat half
    # input copy, output and gloo's flat output (3.9 % low while that moment was not modelled)
    "large-zero3-bf16mix": {"zero": 3, "precision": "bf16-mixed", **LARGE_BASE},
    "qwen2-zero2-bf16mix-ckpt": {"zero": 2, "precision": "bf16-mixed", "grad_ckpt": "full"},
    "qwen3-zero3-bf16mix-ckpt": {"zero": 3, "precision": "bf16-mixed", "grad_ckpt": "full", "lora_dropout": 0.05},
    # with dropout the peak is the end of the recomputed layer's forward (down_proj's lora_A; DESIGN.md): 0.5 % low,
    # a CPU matmul scratch inside lora_A (1.2 % low before that moment was modelled; with dropout 0 the layer's
    # backward peaks and the row is within 0.02 %)
    "llama-zero3-bf16mix-ckpt-dropout": {"zero": 3, "precision": "bf16-mixed", "grad_ckpt": "full",
                                         "lora_dropout": 0.05},
    "qwen3-zero2-bf16mix-qv": {"zero": 2, "precision": "bf16-mixed", "lora_targets": "q_proj,v_proj",
                               "lora_rank": 8},
    # pure bf16 / fp32 adapters with checkpointing: the recompute moments of the single-GPU walk (`lora.py:
    # recompute_moments`), also in the FSDP2 walk (without them these rows were 5-8 % low)
    "zero3-bf16-ckpt-dropout": {"zero": 3, "precision": "bf16", "grad_ckpt": "full", "lora_dropout": 0.05},
    "qwen3-zero2-bf16-ckpt": {"zero": 2, "precision": "bf16", "grad_ckpt": "full"},
    "qwen3-zero3-qlora-bf16-ckpt": {"zero": 3, "precision": "bf16", "grad_ckpt": "full", "method": "qlora",
                                    "quant": "nf4", "lora_dropout": 0.1},
}
QWEN2 = {**CONFIG, "model_type": "qwen2", "tie_word_embeddings": True}
QWEN3 = {**CONFIG, "model_type": "qwen3", "head_dim": 32}


def _config(name: str) -> dict:
    return {"large": LARGE, "qwen2": QWEN2, "qwen3": QWEN3}.get(name.split("-")[0], CONFIG)


# The suite's cover (tests/accuracy) measures this scheme by default; these rows under -m heavy.
RUN = TwoRankRows(BASE, ROWS, _config, sampled=())  # -m heavy: the others


@pytest.mark.parametrize("name", RUN.params())
def test_lora_two_processes(name):
    RUN.check(name)


@pytest.mark.parametrize("fields, flag", [
    ({"method": "lora", "gpus": 2, "tp": 2}, "lora-targets"),  # all-linear: row-parallel targets fail under TP
    ({"method": "lora", "gpus": 2, "tp": 2, "lora_targets": "q_proj", "grad_ckpt": "full"}, "tp"),  # not modelled
    ({"method": "qlora", "quant": "nf4", "precision": "bf16", "gpus": 4, "tp": 2, "zero": 3}, "tp"),  # no TP
])
def test_rejected_multirank_lora(fields, flag):
    with pytest.raises(InputError) as e:
        TrainingPlan(**fields)
    assert e.value.field == flag
