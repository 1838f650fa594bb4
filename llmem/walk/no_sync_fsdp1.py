"""`--no-sync` under FSDP1 (`FullyShardedDataParallel.no_sync` over micro-steps 1..K-1, `components.no_sync`): the
moments of the unsynced micro-steps and of the synced last one, derived from micro-step 1's synced walk
(`walk.fsdp1`). Each unit's unsharded flat gradient (N elements in the gather dtype, `flat_param.unsharded_grad_bytes`)
stays its `.grad` after its post-backward hook returns early (torch 2.13 fsdp/_runtime_utils.py:742-746); a later
micro-step concatenates its views' gradients into a new flat gradient, which AccumulateGrad adds into the kept one in
place (`prepare_gradient_for_backward` keeps a `.grad` of the unsharded size, fsdp/_flat_param.py:1627-1630). The
synced micro-step reduce-scatters the accumulated flat gradient.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmem.components import Category
from llmem.components import activations as act
from llmem.components import flat_param as fp
from llmem.walk.phase import Phase, with_extra

if TYPE_CHECKING:
    from llmem.walk.fsdp1 import Fsdp1Terms

_G = Category.GRADIENTS


def _layer_of(name: str) -> int:
    return int(name.split("(layer ", 1)[1].split(")")[0].split(",")[0])


def fsdp1_no_sync_phases(w: Fsdp1Terms, phases: list[Phase], end: list[Phase], held: dict[str, int]) -> list[Phase]:
    """Micro-step 1's moments (`phases`: forward, head and layers; `end`: the embedding's and the root's, without the
    step) turned into: a later micro-step's forward and head with every flat gradient kept; the synced last
    micro-step's layers with the flat gradients of the units not reduced yet (the layer's own and those below it,
    the root's); an unsynced micro-step's layers (`_unsynced`)."""
    spec, flat = w.spec, w.flat
    acc = [fp.unsharded_grad_bytes(spec, flat, unit) for unit in range(1 + spec.num_layers)]  # root first
    if w.frozen_root:  # LoRA: no gradient reaches the frozen root (`flat_param.requires_grad`)
        acc[0] = 0
    every, label = sum(acc), f"no_sync, micro-step 2..{w.plan.grad_accum}"
    first = next(i for i, ph in enumerate(phases) if ph.name.startswith("backward (layer"))
    out = [with_extra(ph, f"{ph.name} ({label})", _G, every) for ph in phases[:first]]
    for ph in phases[first:]:  # in the reduce-scatter: the kept `.grad` and the new flat gradient it was added
        # into, which the engine keeps alive through the post-hooks (`fsdp1.no_shard_hook_copy_bytes`)
        layer = _layer_of(ph.name)
        out.append(with_extra(ph, f"{ph.name} (no_sync, last micro-step)", _G, sum(acc[:2 + layer])))
    for ph in end:  # every layer reduced; the root's flat gradient kept
        out.append(with_extra(ph, f"{ph.name} (no_sync, last micro-step)", _G, acc[0]))
    return out + _unsynced(w, end, held, acc)


def _unsynced(w: Fsdp1Terms, end: list[Phase], held: dict[str, int], acc: list[int]) -> list[Phase]:
    """An unsynced micro-step's layers and end (micro-step 2 when K ≥ 3, every flat gradient kept; else micro-step
    1, the later layers' kept): the walk's layer moments (`fsdp1.layer_moments`) with those in place of the later
    layers' shards, without the reduce-scatter and cast; at the end the root's views' gradients and flat gradient
    beside them."""
    from llmem.walk.fsdp1 import layer_moments

    later_micro = w.plan.grad_accum > 2
    step = "micro-step 2" if later_micro else "micro-step 1"
    out = []
    for layer in act.backward_layers(w.spec, w.cp, edge=2):
        kept = sum(acc) if later_micro else sum(acc[2 + layer:])
        out += [Phase(f"{ph.name} (no_sync, {step})", ph.breakdown) for ph in layer_moments(w, layer, kept)
                if not ph.name.startswith("reduce-scatter")]
    kept = sum(acc) if later_micro else sum(acc[1:])
    for ph in end:
        if "reduce-scatter" in ph.name or "cast" in ph.name:
            continue
        out.append(with_extra(ph, f"{ph.name} (no_sync, {step})", _G, kept - held[ph.name]))
    return out
