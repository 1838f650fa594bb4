"""Context parallelism (`--cp`) in the sweep's draws (pure, torch-free).

Drawn independently, a cp plan almost never lands on what runs (FSDP2, sdpa, a family with full causal attention and
a `self_attn` module, a sequence that is a multiple of 2 × cp). So in a share of the multi-GPU plans of a family cp
is modelled for (`Family.context_parallel`) with an even GPU count, tp 1, the torch
engine and no pipeline, from a stream of its own (every other draw stays the same), the plan is redrawn as FSDP2
(ZeRO-2 or 3) with sdpa and the options cp is not modelled with turned off (`llmem.support_cp`). Full fine-tuning
and LoRA, checkpointing (none or full, every K) and accumulation are kept as drawn."""

from __future__ import annotations

import random

from llmem.choices import GradCkpt, Loss, Method, Offload
from llmem.families import has_trait

CP_SHARE = 0.5


def eligible(fields: dict, config: dict) -> bool:
    """Whether the drawn plan can become a cp plan: a measured family without sliding-window layers (the sweep's
    mistral has `sliding_window: null`), an even GPU count, tp 1, the torch engine, no pipeline, full or LoRA."""
    return (has_trait(config.get("model_type"), "context_parallel") and not config.get("sliding_window")
            and fields["gpus"] % 2 == 0 and fields["tp"] == 1 and "engine" not in fields and "pp" not in fields
            and fields["method"] in (Method.FULL.value, Method.LORA.value))


def draw_cp(seed: int, index: int, fields: dict, config: dict) -> dict:
    """`--cp` for a share of the eligible plans (`eligible`): cp 2, or the GPU count when it is 4; the sequence
    rounded up to a multiple of 2 × cp (torch's head-tail load balancer's chunks); selective checkpointing becomes
    full; torch's optimizers (unfused SGD/AdamW on DTensors)."""
    rng = random.Random(f"{seed}:{index}:cp")
    if not eligible(fields, config) or rng.random() >= CP_SHARE:
        return {}
    cp = fields["gpus"] if fields["gpus"] == 4 and rng.random() < 0.5 else 2
    seq = -(-fields["seq_len"] // (2 * cp)) * 2 * cp
    out = {"cp": cp, "zero": rng.choice((2, 3)), "seq_len": seq, "attn": "sdpa", "keep_grads": False,
           "optimizer_in_backward": False, "offload": Offload.NONE.value, "loss": Loss.STANDARD.value,
           "loss_chunks": 8, "fsdp_shard": "dim0", "float8": "none", "ddp_bucket_view": False,
           "lora_modules_to_save": ""}
    if fields["grad_ckpt"] == GradCkpt.SELECTIVE.value:
        out["grad_ckpt"] = GradCkpt.FULL.value
    if fields["optimizer"] not in ("adamw", "sgd"):
        out |= {"optimizer": "adamw", "optimizer_impl": "default"}
    elif fields["optimizer_impl"] == "fused":
        out["optimizer_impl"] = "foreach"
    return out
