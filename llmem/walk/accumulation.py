"""`--grad-accum K > 1`: the moments of micro-steps 2..K, derived from micro-step 1's with every gradient of the
earlier micro-steps alive — one device, DDP, ZeRO-1, TP (`accumulation_phases`) and FSDP2
(`fsdp_accumulation_phases`).
"""

from __future__ import annotations

from llmem.components import Category, offload
from llmem.components import attention_core as core
from llmem.components.gradients import (
    accumulated_embedding_gradient_bytes,
    attention_backward_layer_gradient_bytes,
    gradient_bytes,
    later_layers_gradient_bytes,
)
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from llmem.walk.phase import Phase


def accumulation_phases(spec: ModelSpec, plan: TrainingPlan, phases: list[Phase],
                        backward_later: dict[str, int] | None = None) -> list[Phase]:
    """`--grad-accum K > 1`: micro-steps 2..K run forward and backward while every gradient of the previous
    micro-steps is alive (`.grad` is only freed by zero_grad after the step). The forward and loss phases of micro-
    step 1 gain all gradients; in the backward phases the gradients micro-step 1 had (the newly produced ones:
    the lm_head's, a layer's MLP weight gradient) are now transient — AccumulateGrad adds each new gradient into the
    existing `.grad` in place and frees it — on top of all gradients. At the end of backward one more embedding-sized
    gradient is new beside the `.grad`s (`accumulated_embedding_gradient_bytes`: the embedding's, or when tied the
    lm_head's)."""
    grads_all = gradient_bytes(spec, plan)
    later = dict(backward_later) if backward_later is not None else {
        "backward (last layer)": later_layers_gradient_bytes(spec, plan, spec.num_layers - 1),
        "backward (first layer)": later_layers_gradient_bytes(spec, plan, 0)}
    # an attention core runs backward after the layer's MLP and output projection gradients were accumulated
    attention_grads = (core.eager_core_layer_gradient_bytes(spec, plan) if core.applies(spec, plan)
                       else attention_backward_layer_gradient_bytes(spec, plan))
    later = {f"{name[:-1]}, attention core)": v + attention_grads for name, v in later.items()} | later  # walk's win
    out, ends = [], []
    for ph in phases:
        if ph.name.startswith("backward end"):
            ends.append(ph)
            continue
        if ph.name == "optimizer step":
            continue
        b = dict(ph.breakdown)
        new = b[Category.GRADIENTS] - later.get(ph.name, 0)  # what this moment of micro-step 1 had just produced
        b[Category.GRADIENTS] = grads_all + new
        out.append(Phase(f"{ph.name}, gradients alive (micro-step 2)", b))
    new_grad = accumulated_embedding_gradient_bytes(spec, plan)
    for ph in ends:
        b = dict(ph.breakdown)
        b[Category.TEMPORARIES] += new_grad
        what = "tied gradients summed" if ph.name.endswith("summed") else "embedding gradient accumulated"
        out.append(Phase(f"backward end, {what} (micro-step 2)", b))
    return out


def fsdp_accumulation_phases(spec: ModelSpec, plan: TrainingPlan, phases: list[Phase],
                             held: dict[str, int]) -> list[Phase]:
    """FSDP2 with `--grad-accum K > 1` (no `set_requires_gradient_sync(False)`): every micro-step's backward
    reduce-scatters. After micro-step 1 each parameter's sharded `.grad` is a view of its group's reduce-scatter
    output, kept until zero_grad; in micro-steps 2..K `foreach_reduce` finds `sharded_param.grad` set and adds the new
    output into it in place (`grad._local_tensor += new_sharded_grad`), the new output freed when it returns. The
    unsharded gradients are handed to the reduce-scatter and dropped as in micro-step 1 (none is kept unsharded).
    So each moment of micro-step 2 is micro-step 1's with every sharded gradient alive, where the gradients
    micro-step 1 had there beyond the sharded ones it already held (`held`) are transient: the root's unsharded
    gradients, a layer's unsharded gradients before its copy-in, the new reduce-scatter output."""
    grads_all = gradient_bytes(spec, plan) * (0 if offload.is_offloaded(plan) else 1)
    out = []
    for ph in phases:
        if ph.name == "optimizer step":
            continue
        b = dict(ph.breakdown)
        b[Category.GRADIENTS] = grads_all + b[Category.GRADIENTS] - held.get(ph.name, 0)
        out.append(Phase(f"{ph.name}, sharded gradients alive (micro-step 2)", b))
    return out

