"""LoRA with tensor parallelism in the sweep's draws (pure, torch-free).

Drawn independently, a LoRA plan with TP almost never lands on what runs (`llmem.support_lora_tp`: column-parallel
targets, --gpus = --tp, no checkpointing, one micro-step, ...): seed 11's first 3,000 draws hold
342 LoRA/QLoRA plans with TP and not one the estimate accepts. So in a share of the cpu profile's LoRA plans drawn
with --gpus = --tp, from a stream of its own (every other draw stays the same), the plan's other options are set to
what LoRA + TP is modelled with and the targets drawn among the model's column-parallel Linears."""

from __future__ import annotations

import random

LORA_TP_SHARE = 0.5
# column-parallel Linears in transformers' plans of the llama-like families (`base_model_tp_plan`: colwise)
COLWISE_TARGETS = ("q_proj,v_proj", "q_proj,k_proj,v_proj", "gate_proj,up_proj",
                   "q_proj,k_proj,v_proj,gate_proj,up_proj")


def draw_lora_tp(seed: int, index: int, fields: dict, device: str) -> dict:
    """The LoRA + TP settings for a share of the cpu profile's LoRA plans with --gpus = --tp, or nothing."""
    rng = random.Random(f"{seed}:{index}:lora-tp")
    if device != "cpu" or fields["method"] != "lora" or fields["tp"] < 2 or fields["gpus"] != fields["tp"] \
            or rng.random() >= LORA_TP_SHARE:
        return {}
    out = {"lora_targets": rng.choice(COLWISE_TARGETS), "grad_ckpt": "none",
           "ckpt_every": 1, "lora_modules_to_save": "", "grad_accum": 1, "loss": "standard", "keep_grads": False,
           "offload": "none", "optimizer_in_backward": False}
    if fields["optimizer"] not in ("adamw", "sgd"):
        out |= {"optimizer": "adamw", "optimizer_impl": "forloop"}
    return out
