"""`--no-sync` under FSDP2 (`set_requires_gradient_sync(False)` over micro-steps 1..K-1, `components.no_sync`): the
moments of the unsynced micro-steps and of the synced last one, derived from micro-step 1's synced walk
(`walk.fsdp.fsdp_phases`) with the unsharded accumulated gradients alive.

- Unsynced (micro-step 2 when K ≥ 3, where every accumulated gradient is alive; else micro-step 1): each layer's
  backward as in the walk with the later layers' accumulated gradients in place of their shards and no
  reduce-scatter buffer; the post-backward keeps the layer's gradient (cast into the reduce dtype in micro-step 1 under
  a MixedPrecisionPolicy) instead of reduce-scattering it.
- Every micro-step after the first: its forward and loss with every accumulated gradient alive.
- Synced last micro-step: each layer's backward with the accumulated gradients of the layers not yet reduced (it and
  those below it) and the root's, the later layers' shards as in micro-step 1; its reduce-scatter copies in the
  accumulated gradient instead of the new one.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import TYPE_CHECKING

from llmem.components import Category
from llmem.components import no_sync as ns
from llmem.components.activations import backward_layers
from llmem.walk.phase import Phase

if TYPE_CHECKING:
    from llmem.walk.fsdp import FsdpTerms

_LAYER = re.compile(r"\(layer (\d+)")
_G, _C = Category.GRADIENTS, Category.COMMUNICATION


def _renamed(ph: Phase, name: str, gradients: int, communication: int = 0) -> Phase:
    b = dict(ph.breakdown)
    b[_G] += gradients
    b[_C] += communication
    return Phase(name, b)


def _split(phases: list[Phase]) -> tuple[list[Phase], list[Phase], list[Phase]]:
    """Micro-step 1's moments before the layers' backward (forward, loss, head), the layers' and the root's after."""
    first = next(i for i, ph in enumerate(phases) if ph.name.startswith("backward (layer"))
    end = next(i for i, ph in enumerate(phases) if ph.name.startswith("backward end"))
    return phases[:first], phases[first:end], [ph for ph in phases[end:] if ph.name != "optimizer step"]


def fsdp_no_sync_phases(w: FsdpTerms, phases: list[Phase], held: dict[str, int]) -> list[Phase]:
    """The unsynced and last micro-steps' moments (module docstring); `held`: the sharded gradients micro-step 1
    holds at each moment (`walk.fsdp`)."""
    spec, plan, cp = w.spec, w.plan, w.cp
    acc = [ns.layer_accumulated_bytes(spec, plan, cp, k) for k in range(w.layers)]
    root, every = ns.root_accumulated_bytes(spec, plan, cp), ns.accumulated_bytes(spec, plan, cp)
    before, layers, after = _split(phases)
    head_made = next((i for i, ph in enumerate(before) if ph.name == "lm_head backward"), len(before))
    # a later micro-step's forward and head: every accumulated gradient alive; once lm_head's new gradient was added
    # in place (AccumulateGrad) it is no longer a tensor of its own
    out = [_renamed(ph, f"{ph.name} (no_sync, micro-step 2..{plan.grad_accum})",
                    every - (w.root_grads_head if ns.in_place(plan) and i > head_made else 0))
           for i, ph in enumerate(before)]
    out += _last_layer_moments(w, layers, acc, root)
    out += [_renamed(ph, f"{ph.name} (no_sync, last micro-step)", 0 if ns.in_place(plan) else root) for ph in after]
    return out + _unsynced_moments(w, after, held, acc, every)


def _last_layer_moments(w: FsdpTerms, layers: list[Phase], acc: list[int], root: int) -> list[Phase]:
    """The synced last micro-step's layer moments: micro-step 1's with the accumulated gradients of the layers not
    reduced yet and the root's (in place: the head's new gradient is in the root's); the reduce-scatter copies in
    the layer's accumulated gradient (the new one was added into it and freed, `accumulate_unsharded_grad_if_needed`)
    and after it the layer's accumulated gradient is freed with the new one."""
    out, head = [], w.root_grads_head if ns.in_place(w.plan) else 0
    for ph in layers:
        layer = int(_LAYER.search(ph.name).group(1))
        below = sum(acc[:layer])
        if ph.name.startswith("reduce-scatter copy-in"):
            extra = below + acc[layer] - w.layer_grads[layer]
        elif ph.name.startswith("reduce-scatter"):
            extra = below
        else:
            extra = below + acc[layer] - _added_in_place(w, ph.name)
        out.append(_renamed(ph, f"{ph.name} (no_sync, last micro-step)", extra + root - head))
    return out + _weight_made_moments(w, out)


_BACKWARD = re.compile(r"backward \(layer \d+(?:, ([^)]+))?\)")


def _added_in_place(w: FsdpTerms, name: str) -> int:
    """In place (`no_sync.in_place`), the layer's weight gradients micro-step 1's moment holds beside the later
    layers' are no tensors of their own: each AccumulateGrad added its new gradient into the kept one and freed it
    (torch/csrc/autograd/functions/accumulate_grad.h, `components.grad_accum`). Those made before the moment: at the
    MLP's, none (its last Linear's new weight gradient was added before the activation's backward,
    `grad_accum.mlp_weight_gradient_released_bytes`); at a norm's, those of the nodes after it
    (`rms_norm_backward.weight_gradient_bytes`); at the attention core's, sdpa's and q's, those after the core
    (`attention_core.eager_core_layer_gradient_bytes`)."""
    from llmem.components import attention_core as core
    from llmem.components import grad_accum
    from llmem.components import rms_norm_backward as rms_bwd

    m = _BACKWARD.fullmatch(name)
    if not ns.in_place(w.plan) or m is None or w.lora:  # LoRA: its adapters' few, counted twice (measured exact)
        return 0
    what = m.group(1)
    if what is None:
        return grad_accum.mlp_weight_gradient_released_bytes(w.spec, w.cp)
    if what in ("pre-MLP norm", "input norm"):
        return rms_bwd.weight_gradient_bytes(w.spec, w.cp, rms_bwd.PRE_MLP if what == "pre-MLP norm" else rms_bwd.INPUT)
    if what in ("attention core", "sdpa backward", "q RoPE backward", "q_norm backward"):
        return core.eager_core_layer_gradient_bytes(w.spec, w.cp)
    return 0


def _weight_made_moments(w: FsdpTerms, moments: list[Phase]) -> list[Phase]:
    """In place: the span of the last MLP Linear's new weight gradient, from its MmBackward0 to its AccumulateGrad
    (`weight_gradient.made_gradient_bytes`), in place of the MLP moment's activation gradients."""
    from llmem.components import weight_gradient
    from llmem.walk.fsdp_layer import _backward_terms

    if not ns.in_place(w.plan) or not weight_gradient.applies(w.spec, w.cp):
        return []
    out = []
    for ph in moments:
        m = _BACKWARD.fullmatch(ph.name.rsplit(" (no_sync", 1)[0])
        if m is not None and m.group(1) is None:
            layer = int(_LAYER.search(ph.name).group(1))
            made = weight_gradient.made_gradient_bytes(w.spec, w.cp) - _backward_terms(w, layer)[2] \
                + _added_in_place(w, ph.name.rsplit(" (no_sync", 1)[0])
            out.append(_renamed(ph, ph.name.replace(")", ", MLP weight gradient made)", 1), made))
    return out


def _unsynced_moments(w: FsdpTerms, after: list[Phase], held: dict[str, int], acc: list[int],
                      every: int) -> list[Phase]:
    """An unsynced micro-step's layer and end moments: the layer walk (`fsdp_layer.fsdp_layer_moments`) with the
    accumulated gradients in place of the later layers' shards and no reduce-scatter input retained; the
    reduce-scatter's copy-in becomes the post-backward keeping the gradient (micro-step 1 under a
    MixedPrecisionPolicy: the reduce-dtype copy beside the half one), the collective is gone. With K ≥ 3 micro-step
    2 has every accumulated gradient alive (in place: the head's new gradient added into the root's)."""
    from llmem.walk.fsdp_layer import fsdp_layer_moments

    plan, later_micro = w.plan, w.plan.grad_accum > 2
    step = "micro-step 2" if later_micro else "micro-step 1"
    suffix = [sum(acc[k + 1:]) for k in range(w.layers)]
    sharded_later = tuple(every for _ in acc) if later_micro else tuple(suffix)
    head = 0 if later_micro and ns.in_place(plan) else w.root_grads_head
    u = replace(w, sharded_later=sharded_later, rs_ins=(0,) * w.layers, root_grads_head=head)
    out, scratch = [], {}
    for layer in backward_layers(w.spec, w.cp, edge=2):
        for ph in fsdp_layer_moments(u, layer, scratch):
            if ph.name.startswith("reduce-scatter copy-in"):
                cast = acc[layer] if not later_micro and not ns.in_place(plan) else 0
                out.append(_renamed(ph, f"post-backward, gradient kept (layer {layer}) (no_sync, {step})", cast,
                                    -w.copy_in_extras[layer]))
            elif not ph.name.startswith("reduce-scatter"):  # micro-step 2: the kept gradients include the layer's
                out.append(_renamed(ph, f"{ph.name} (no_sync, {step})",
                                    -_added_in_place(w, ph.name) if later_micro else 0))
    end = after[0]  # the end of backward: every layer's gradient kept, no reduce-scatter input waiting
    root_grads = end.breakdown[_G] - held.get(end.name, 0)  # the root's unsharded gradients micro-step 1 holds
    if later_micro:  # in place: the root's new gradients are added into its accumulated ones (in `every`)
        grads = every if ns.in_place(plan) else root_grads + every
    else:
        grads = root_grads + sum(acc)
    out.append(_renamed(end, f"{end.name} (no_sync, {step})", grads - end.breakdown[_G], -w.rs_ins[0]))
    return out + (_weight_made_moments(w, out) if later_micro else [])
