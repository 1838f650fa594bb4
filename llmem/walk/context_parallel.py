"""`--cp N`: the walk of a context-parallel rank — the FSDP2 walk of its sequence shard (`cpc.local_plan`: the plan
on seq_len / cp tokens) with what context parallelism adds at each moment (`llmem.components.context_parallel`),
for the worst rank of a group (any but the last), and the ring's own moments in each layer's attention backward."""

from __future__ import annotations

import re

from llmem.components import Category
from llmem.components import context_parallel as cpc
from llmem.walk.phase import Phase

_A = Category.ACTIVATIONS
_LAYER = re.compile(r"layer (\d+)")


def _copies(name: str, layers: int) -> int:
    """How many layers' attention-output copies (`cpc.attention_copy_bytes`) are held at the moment `name`."""
    if name.startswith("forward"):
        m = _LAYER.search(name)
        return layers if m is None else int(m.group(1))  # layer i's all-gather: layers 0 .. i-1 have run
    if name.startswith(("loss", "lm_head", "final norm")):  # (the final norm's backward: before any layer's)
        return layers
    m = _LAYER.search(name)
    if m is None:  # backward end, optimizer step
        return 0
    i = int(m.group(1))
    held = name.endswith("pre-backward all-gather)") or name == f"backward (layer {i})"
    return i + 1 if held else i


def _extra(spec, plan, name: str) -> int:
    """The bytes `--cp` adds to the local plan's moment `name`."""
    buffers = cpc.step_buffers_bytes(plan)
    if name.startswith("optimizer"):  # after the context: the step's buffers only
        return buffers
    extra = buffers + cpc.context_held_bytes(plan) + cpc.rope_batch_bytes(spec, plan)
    extra += _copies(name, spec.num_layers) * cpc.attention_copy_bytes(spec, plan)
    if name.startswith("forward"):
        extra += cpc.packed_mask_bytes(plan)
    return extra


def cp_phases(spec, plan, walk) -> list[Phase]:
    """The local plan's moments (`walk(spec, local_plan)`) with `_extra` in activations, and after each layer's
    `sdpa backward` moment the ring's backward at its largest instant (`cpc.ring_backward_bytes`)."""
    if type(plan.seq_len) is not int or type(plan.batch_size) is not int:
        raise TypeError("the context-parallel walk is not traced")  # `walk.replay` walks it each time
    local = cpc.local_plan(plan)
    phases = []
    for ph in walk(spec, local):
        extra = _extra(spec, plan, ph.name)
        b = dict(ph.breakdown)
        b[_A] += extra
        phases.append(Phase(ph.name, b))
        if ph.name.endswith("sdpa backward)"):
            phases.append(_ring(ph, b, cpc.ring_backward_bytes(spec, plan), "ring attention backward"))
            if plan.cp == 2:  # the last rank: no copies or mask, but a full q in the second call
                own = dict(ph.breakdown)
                own[_A] += extra - _copies(ph.name, spec.num_layers) * cpc.attention_copy_bytes(spec, plan)
                phases.append(_ring(ph, own, cpc.ring_backward_bytes(spec, plan, last=True),
                                    "ring attention backward, last rank"))
    return phases


def _ring(ph: Phase, breakdown: dict, ring: int, label: str) -> Phase:
    b = dict(breakdown)
    b[Category.TEMPORARIES] += ring
    return Phase(ph.name.replace("sdpa backward", label), b)
