"""`--lora-adapter-dtype base` in the sweep's draws (pure, torch-free).

The adapters in the base's dtype (PEFT's `autocast_adapter_dtype=False`: torchtune's, Answer.AI's and LitGPT's
bf16-true programs) are modelled for LoRA on a pure bf16 base on one GPU, DDP, FSDP2 and FSDP1, on the hand-written
LoRA tables (`llmem.support_lora_dtype`). Drawn from a stream of its own (every other draw stays the same) in a
half of the LoRA plans on such a family, with the precision set to what those programs run (pure bf16; as
`lora_tp` sets its options: drawn independently, LoRA on a pure bf16 base that the plan accepts is rare, two plans
in 600 small ones of seed 2); the draw is kept where the plan accepts it, so the sweep compares it instead of
recording a gap."""

from __future__ import annotations

import random

from llmem.errors import InputError
from llmem.plan import TrainingPlan

LORA_DTYPE_SHARE = 0.5


def draw_lora_adapter_dtype(seed: int, index: int, fields: dict, lora_tables: bool) -> dict:
    """`{"lora_adapter_dtype": "base", "precision": "bf16"}` for a share of the LoRA plans that run it, or nothing;
    `lora_tables`: the model is a dense family with hand-written LoRA tables (`draw._lora_tables`: traced ones and
    mixtures of experts are a gap for the option, `support_lora_dtype.check_model`)."""
    rng = random.Random(f"{seed}:{index}:lora-adapter-dtype")
    if fields["method"] != "lora" or not lora_tables or rng.random() >= LORA_DTYPE_SHARE:
        return {}
    out = {"lora_adapter_dtype": "base", "precision": "bf16"}
    try:
        TrainingPlan(**(fields | out))
    except InputError:
        return {}
    return out

