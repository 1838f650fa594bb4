"""`--grad-accum K > 1`: the moments of micro-steps 2..K, derived from micro-step 1's with every gradient of the
earlier micro-steps alive — one device, DDP, ZeRO-1, TP (`accumulation_phases`) and FSDP2
(`fsdp_accumulation_phases`). `--keep-grads` (`zero_grad(set_to_none=False)`) gives micro-step 1 the same moments:
the previous step's zeroed gradients are alive (`gradients_kept`).
"""

from __future__ import annotations

from llmem.components import Category, offload
from llmem.components import activations as act
from llmem.components import attention_core as core
from llmem.components.gradients import (
    accumulated_embedding_gradient_bytes,
    attention_backward_layer_gradient_bytes,
    gradient_bytes,
    head_held_gradient_bytes,
    later_layers_gradient_bytes,
)
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from llmem.walk.phase import Phase


def gradients_kept(plan: TrainingPlan) -> bool:
    """Whether a micro-step runs with every gradient already allocated: a later micro-step of --grad-accum, or any
    with --keep-grads (`torch/optim/optimizer.py` `Optimizer.zero_grad`: with `set_to_none=False` each `.grad` is
    zeroed in place, and AccumulateGrad / FSDP2's post-backward then add into it instead of assigning a new one)."""
    return plan.grad_accum > 1 or plan.keep_grads


def _when(plan: TrainingPlan) -> str:
    return "micro-step 2" if plan.grad_accum > 1 else "gradients kept by zero_grad(set_to_none=False)"


def accumulation_phases(spec: ModelSpec, plan: TrainingPlan, phases: list[Phase],
                        backward_later: dict[str, int] | None = None,
                        mlp_held: dict[str, int] | None = None) -> list[Phase]:
    """`--grad-accum K > 1`: micro-steps 2..K run forward and backward while every gradient of the previous
    micro-steps is alive (`.grad` is only freed by zero_grad after the step). The forward and loss phases of micro-
    step 1 gain all gradients; in the backward phases the gradients micro-step 1 had just produced there (the
    lm_head's at its backward, a layer's MLP weight gradient; not the later layers' and the head's `.grad`s) are now
    transient — AccumulateGrad adds each new gradient into the
    existing `.grad` in place and frees it — on top of all gradients. At the end of backward one more embedding-sized
    gradient is new beside the `.grad`s (`accumulated_embedding_gradient_bytes`: the embedding's, or when tied the
    lm_head's)."""
    grads_all = gradient_bytes(spec, plan)
    later = dict(backward_later) if backward_later is not None else {
        "backward (last layer)": later_layers_gradient_bytes(spec, plan, spec.num_layers - 1),
        "backward (first layer)": later_layers_gradient_bytes(spec, plan, 0)}
    # in a layer's backward the head's gradients micro-step 1 held are `.grad`s too (`head_held_gradient_bytes`)
    head = head_held_gradient_bytes(spec, plan)
    later = {name: v + head for name, v in later.items()}
    # an attention core runs backward after the layer's MLP and output projection gradients were accumulated
    attention_grads = (core.eager_core_layer_gradient_bytes(spec, plan) if core.applies(spec, plan)
                       else attention_backward_layer_gradient_bytes(spec, plan))
    later |= {f"{name[:-1]}, attention core)": v + attention_grads for name, v in later.items()}
    # a layer's MLP moment also holds the layer's weight gradients made by earlier nodes (MoE experts: `mlp_held`)
    later |= {name: later.get(name, 0) + v for name, v in (mlp_held or {}).items()}
    out, ends = forward_core_moments(spec, plan, phases, grads_all), []
    for ph in phases:
        if ph.name.startswith("backward end"):
            ends.append(ph)
            continue
        if ph.name == "optimizer step":
            continue
        b = dict(ph.breakdown)
        # what this moment of micro-step 1 had just produced
        new = b[Category.GRADIENTS] - later.get(ph.name, later.get(_base_moment(ph.name), 0))
        b[Category.GRADIENTS] = grads_all + new
        out.append(Phase(f"{ph.name}, gradients alive ({_when(plan)})", b))
    new_grad = accumulated_embedding_gradient_bytes(spec, plan)
    for ph in ends:
        b = dict(ph.breakdown)
        b[Category.TEMPORARIES] += new_grad
        what = "tied gradients summed" if ph.name.endswith("summed") else "embedding gradient accumulated"
        out.append(Phase(f"backward end, {what} ({_when(plan)})", b))
    return out


def _base_moment(name: str) -> str:
    """QLoRA's layer-backward moments with a weight dequantized (`walk.single.qlora_moments`: `<moment>, <bits> weight
    dequantized`) hold their base moment's gradients: the same `.grad`s made before it."""
    return name.rsplit(", ", 1)[0] if name.endswith(" weight dequantized") else name


def forward_core_moments(spec: ModelSpec, plan: TrainingPlan, phases: list[Phase], grads_all: int) -> list[Phase]:
    """The last decoder layer's eager softmax in forward, every gradient alive: the end of forward's moment less the
    final norm's saved tensors and the copies of the Linears after the core (not made yet), plus the layer's forward
    tensors and the softmax's (`attention_core.forward_*`). Only where that layer is checkpointed: a layer that saves
    its tensors holds all of them, and more, at its softmax backward. In micro-step 1 the backward's recompute of the
    same softmax is larger (it holds the later layers' gradients and no other layer's weight copies)."""
    last = spec.num_layers - 1
    end = next((ph for ph in phases if ph.name == "forward (last layer)"), None)
    if end is None or not core.forward_applies(spec, plan) or not plan.checkpointed(last):
        return []
    b = dict(end.breakdown)
    b[Category.GRADIENTS] = grads_all
    b[Category.ACTIVATIONS] += core.forward_intermediate_bytes(spec, plan) - act.final_norm_bytes(spec, plan)
    b[Category.TEMPORARIES] += core.forward_softmax_bytes(spec, plan) - core.forward_later_copy_bytes(spec, plan)
    return [Phase(f"forward (last layer, attention core), gradients alive ({_when(plan)})", b)]


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
        out.append(Phase(f"{ph.name}, sharded gradients alive ({_when(plan)})", b))
    return out

