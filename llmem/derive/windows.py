"""A traced window's live bytes per event (`llmem.derive.trace`: a decoder layer's backward, its forward, its
recompute), from the allocation tracker's events."""

from __future__ import annotations


def _window(events, window: list[int], grad_out: int, skip=frozenset(), in_place=frozenset()) -> list[tuple[str, int]]:
    """Live bytes after each event of a layer's backward (or forward), relative to its start, plus the output
    grad; the blocks in `skip` (autocast's weight copies) left out. `in_place`: the blocks that became `.grad`s —
    in a later micro-step AccumulateGrad adds each new gradient into the `.grad` (`variable_grad += new_grad`,
    torch/csrc/autograd/functions/accumulate_grad.h `accumulateGrad`) and frees it, so from the next event on it
    is no longer live here (the `.grad`s are counted apart, as every gradient alive)."""
    if len(window) < 2:
        return [("layer output gradient", grad_out)]
    start, end = window[0], window[1]
    live, out, added = grad_out, [("layer output gradient", grad_out)], 0
    for k in range(start, end):
        live += events[k][2] if events[k][1] not in skip else 0
        out.append((f"event {k - start}", live - added))
        if events[k][1] in in_place and events[k][2] > 0:
            added += events[k][2]
    return out
