"""The final norm's backward in the walks: after the lm_head's backward, before the last decoder layer's.

One moment, the same in every walk: the forward's activations less what the lm_head (and project_out) saved of the
norm's output, the gradients the lm_head's backward left (the walk's own: its `.grad`, FSDP's unsharded root
gradient), the norm's traced backward (`llmem.components.final_norm.backward_bytes`: its output gradient,
temporaries, input and weight gradients), the held logits and what the walk keeps gathered there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmem.components import final_norm as fnorm
from llmem.components import lora
from llmem.components import lora_activations as lora_act
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from llmem.walk.phase import Phase, moment

if TYPE_CHECKING:
    from llmem.walk.single import Terms

NAME = "final norm backward"


def released_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """What the modules after the norm saved of its output (`final_norm.after_norm_saved_bytes`), from the list of
    the final norm's saved tensors the walk counted (hand-written LoRA: its own)."""
    hand_lora = lora.is_lora(plan) and spec.derived is None
    return fnorm.after_norm_saved_bytes(spec, plan, lora_act.final_norm_saved(spec, plan) if hand_lora else None)


def norm_moment(spec: ModelSpec, plan: TrainingPlan, persistent: dict, forward_acts: int, gradients: int,
                logits: int, communication: int = 0, temporaries: int = 0) -> list[Phase]:
    """The moment, or none where the model has no final norm traced (`plan`: the compute plan)."""
    bwd = fnorm.backward_bytes(spec, plan)
    if not bwd:
        return []
    return [moment(NAME, **persistent, activations=forward_acts - released_bytes(spec, plan),
                   gradients=gradients + bwd, logits=logits, communication=communication, temporaries=temporaries)]


def final_norm_moment(t: Terms) -> list[Phase]:
    """One device, DDP, ZeRO-1, TP: the lm_head's `.grad` made, autocast's saved layer weight copies alive."""
    return norm_moment(t.spec, t.plan, t.persistent, t.forward_acts, t.grads_outer, t.logits,
                       t.gathered(t.layers), t.base_casts)
