"""`--activation-offload` in the sweep's draws (pure, torch-free).

torchtune's activation offloading runs only on CUDA with every decoder layer checkpointed (`llmem.support_activation`),
so the cuda profile draws it, from a stream of its own (every other draw stays the same), in a share of its full
fine-tunes in full or half precision (the simulate oracle has no autocast kernels: mixed precision it refuses) on one
engine of PyTorch's own: drawn independently, full checkpointing of every layer with a loss it is modelled for is rare
(two plans in 600 small ones of seed 2), so those options are set to what torchtune's recipes run (as `lora_tp`
does), and the draw is kept where the plan accepts it and the model is one it is modelled for
(`act_offload.check_model`)."""

from __future__ import annotations

import random

from llmem.components import act_offload
from llmem.errors import InputError
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec

ACT_OFFLOAD_SHARE = 0.5


def draw_activation_offload(seed: int, index: int, fields: dict, config: dict) -> dict:
    """`{"activation_offload": True}` for a share of the cuda profile's plans that run it, or nothing."""
    rng = random.Random(f"{seed}:{index}:activation-offload")
    if fields["device"] != "cuda" or "mixed" in fields["precision"] or fields["method"] != "full" \
            or "engine" in fields or "pp" in fields or rng.random() >= ACT_OFFLOAD_SHARE:
        return {}
    out = {"activation_offload": True, "grad_ckpt": "full", "ckpt_every": 1}
    if fields["loss"] == "fused-linear-ce":
        out["loss"] = "standard"
    try:
        plan = TrainingPlan(**(fields | out))
        act_offload.check_model(ModelSpec.from_config(dict(config)), plan)
    except InputError:
        return {}
    return out
