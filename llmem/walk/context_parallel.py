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
_LATER = re.compile(r", (?:sharded )?gradients alive \([^)]*\)$")  # `walk.accumulation`'s micro-steps 2..K


def _base(name: str) -> str:
    """The moment's name in the micro-step's own terms: `--grad-accum`'s later micro-steps run the same moments as
    the first (each enters its own context, transformers 5.23 `trainer.py:2393-2487`), with the gradients alive."""
    return _LATER.sub("", name)


def _copies(name: str, plan, layers: int) -> int:
    """How many layers' attention-output copies (`cpc.attention_copy_bytes`) are held at the moment `name`: those
    autograd saved (o_proj keeps its input) in the layers run and not yet back-propagated, bar the checkpointed ones
    (`--grad-ckpt full`: the layer saves nothing but its input; its recompute in backward makes the copy again, held
    to o_proj's backward like a saved one)."""
    saved = lambda n: sum(not plan.checkpointed(j) for j in range(n))  # noqa: E731 - layers 0 .. n-1
    if name.startswith("forward"):
        m = _LAYER.search(name)
        return saved(layers) if m is None else saved(int(m.group(1)))  # layer i's all-gather: 0 .. i-1 have run
    if name.startswith(("loss", "lm_head", "final norm")):  # (the final norm's backward: before any layer's)
        return saved(layers)
    m = _LAYER.search(name)
    if m is None:  # backward end, optimizer step
        return 0
    i = int(m.group(1))
    held = name.endswith("pre-backward all-gather)") and not plan.checkpointed(i) or name == f"backward (layer {i})"
    return saved(i) + held


def _saving_layers(name: str, plan, layers: int) -> list[int]:
    """The layers whose saved tensors exist at the moment `name`: those run and not yet back-propagated, bar the
    checkpointed ones (saved again by their recompute, from their backward on); in layer i's own backward moments
    layer i too (before its pre-backward all-gather if it is not checkpointed)."""
    run = lambda n: [j for j in range(n) if not plan.checkpointed(j)]  # noqa: E731 - layers 0 .. n-1
    m = _LAYER.search(name)
    if name.startswith("forward"):
        return run(layers) if m is None else run(int(m.group(1)))
    if name.startswith(("loss", "lm_head", "final norm")):
        return run(layers)
    if m is None:
        return []
    i = int(m.group(1))
    own = name.startswith("backward") and not (name.endswith("pre-backward all-gather)") and plan.checkpointed(i))
    return run(i) + [i] * own


def _mask_held(name: str, plan) -> bool:
    """The packed mask (`cpc.packed_mask_bytes`) is built in the forward; a checkpointed layer's frame keeps it
    (transformers' `GradientCheckpointingLayer` checkpoints `partial(forward, self, **kwargs)`, attention_mask among
    the kwargs, `modeling_layers.py:120`) until that layer's backward is done: layer 0's, the last, is checkpointed
    whenever any is."""
    if name.startswith("forward"):
        return True
    if not plan.checkpointed(0) or name.startswith(("optimizer", "backward end")):
        return False
    return not name.startswith("reduce-scatter") or not name.endswith("(layer 0)")


def _extra(spec, plan, name: str) -> int:
    """The bytes `--cp` adds to the local plan's moment `name`."""
    name = _base(name)
    buffers = cpc.step_buffers_bytes(plan)
    if name.startswith("optimizer"):  # after the context: the step's buffers only
        return buffers
    extra = buffers + cpc.context_held_bytes(plan) + cpc.rope_batch_bytes(spec, plan)
    extra += _copies(name, plan, spec.num_layers) * cpc.attention_copy_bytes(spec, plan)
    if spec.derived is not None:
        extra += sum(cpc.rope_layer_batch_bytes(spec, plan, j) for j in _saving_layers(name, plan, spec.num_layers))
    if _mask_held(name, plan):
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
        if _base(ph.name).endswith("sdpa backward)"):
            phases.append(_ring(ph, b, cpc.ring_backward_bytes(spec, plan), "ring attention backward"))
            if plan.cp == 2:  # the last rank: no copies or mask, but a full q in the second call
                own = dict(ph.breakdown)
                name = _base(ph.name)
                own[_A] += extra - _copies(name, plan, spec.num_layers) * cpc.attention_copy_bytes(spec, plan) \
                    - _mask_held(name, plan) * cpc.packed_mask_bytes(plan)
                phases.append(_ring(ph, own, cpc.ring_backward_bytes(spec, plan, last=True),
                                    "ring attention backward, last rank"))
    if not any(_base(ph.name).endswith("sdpa backward)") for ph in phases):
        _check_ring_below_peak(spec, plan, phases)
    return phases


def _check_ring_below_peak(spec, plan, phases: list[Phase]) -> None:
    """A walk without an sdpa-backward moment (dense and MoE LoRA and full fine-tuning have theirs,
    `query_backward.applies_sdpa`, `applies_lora_sdpa`, `applies_moe_sdpa`) has no instant to put the ring's
    buffers on. Each layer's backward moment plus the ring's buffers and sdpa's own outputs
    (`qb.sdpa_transient_bytes`) bounds the ring's instant from above; the estimate stands where that bound stays
    below the peak (the ring cannot be the peak), else the plan is a gap."""
    from llmem.components import query_backward as qb
    from llmem.errors import GAP, InputError

    ring = max(cpc.ring_backward_bytes(spec, plan), cpc.ring_backward_bytes(spec, plan, last=True)) \
        + qb.sdpa_transient_bytes(spec, cpc.local_plan(plan))
    peak = max(ph.total for ph in phases)
    layer = re.compile(r"backward \(layer \d+\)$")
    if any(ph.total + ring > peak for ph in phases if layer.match(_base(ph.name))):
        raise InputError("cp", "the ring attention's backward may be the peak here (a wide attention, a small "
                         "vocabulary), and this walk has no sdpa-backward moment to place it on; use --method "
                         "full, or --cp 1", GAP)


def _ring(ph: Phase, breakdown: dict, ring: int, label: str) -> Phase:
    b = dict(breakdown)
    b[Category.TEMPORARIES] += ring
    return Phase(ph.name.replace("sdpa backward", label), b)
