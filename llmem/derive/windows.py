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


def inflight_window(events, window: list[int], copies: set, matrices: set, lora: bool) -> list[tuple[str, int]]:
    """A layer's whole forward from 0 (`Trace.inflight`), autocast's weight copies each counted from the event that
    makes it (a copy made later in the layer is not yet alive at an earlier peak), less what the walk counts of
    them apart: under LoRA nothing (the copies mm saves are in the layer's table, the others are transients of the
    forward); otherwise every weight-matrix copy the window makes, which the walk holds whole through the forward
    (`autocast.forward_copy_layers`, the cache of `cached_cast`, aten/src/ATen/autocast_mode.cpp). Without autocast
    there are no copies. glm4 eager LoRA bf16-mixed: its attention core's fp32 softmax sits beside q's, k's, v's
    and the adapters' bf16 copies, which the window without them missed (-3.75 % of the step's peak)."""
    if len(window) < 2:
        return _window(events, window, 0)
    made = 0 if lora else sum(events[k][2] for k in range(window[0], window[1])
                              if events[k][1] in matrices and events[k][2] > 0)
    return [(n, b - made) for n, b in _window(events, window, 0)]


def at_event(lives: list[list[tuple[str, int]]], windows: dict[int, list[int]], ends: list[int]) -> list:
    """Per layer, of its backward window's live bytes (`_window`; `windows`: its event indices), the value when
    sdpa's backward kernel has returned (`ends`: the event count then; the last one inside the window), as
    [("sdpa backward", bytes)]; [] if the layer ran none (eager attention, a math-path sdpa). The moment context
    parallelism's ring extends."""
    out = []
    for i, live in enumerate(lives):
        window = windows.get(i, [])
        inside = [e for e in ends if len(window) >= 2 and window[0] < e <= window[1]]
        out.append([("sdpa backward", live[inside[-1] - window[0]][1])] if inside else [])
    return out
