"""Layer kinds: the decoder layers grouped by what they save and what their backward allocates.

Not every architecture repeats one layer: Gemma 3 runs five sliding-window layers to one full-attention layer
(`config.layer_types`; a sliding layer's explicit mask and its RoPE tables differ from a full one's), others have
dense first layers or a per-layer pattern. A kind is one set of fitted tables (the layer's saved tensors, the events
of its backward, those of its forward up to its last saved tensor: a checkpointed layer's recompute, also with the
autocast weight copies as made, `trace.Trace.recomputes`); `group`
returns the kinds and the kind of every decoder layer, in order of first appearance (layer 0 is of kind 0). Layers
whose traces are identical at every traced point are fitted once; layers whose fitted tables are equal (the same
saving modules, with the layer index and the allocating op left out, the same coefficients) are one kind.

A layer's backward (and forward) is kept as the events that can be its peak (`peak_candidates`): every monomial of
the fit is >= 0 for b, s >= 1, so an event whose coefficients another's dominate one by one is never above it.
Pure Python: no torch.
"""

from __future__ import annotations

import re

from llmem.derive.fit import fit_sequence

LAYER_INDEX = re.compile(r"\.\d+\.")


def saver(name: str) -> str:
    """The saving module of a traced name, without the layer index and the op that allocated the storage."""
    return LAYER_INDEX.sub(".N.", name.split(": ")[0], count=1)


def peak_candidates(events: list) -> list:
    """Of a backward window's fitted events [(name, coefficients)], those no other event dominates coefficient by
    coefficient (the first of equal ones), in window order."""
    first: dict[tuple, str] = {}
    for name, c in events:
        first.setdefault(tuple(c), name)
    unique = [(name, c) for c, name in first.items()]

    def dominated(c, by) -> bool:
        return by != c and all(x >= y for x, y in zip(by, c, strict=True))

    coeffs = [tuple(c) for _, c in unique]
    return [(name, c) for name, c in unique if not any(dominated(tuple(c), other) for other in coeffs)]


def _raw_key(traces: list, i: int) -> str:
    """Layer `i`'s traces at every point: savers and bytes, the backward's and the forward's live bytes."""
    return repr([([(saver(n), b) for n, b in t.layers[i]], [b for _, b in t.backwards[i]],
                  [b for _, b in t.forwards[i]], [b for _, b in t.accumulating[i]],
                  [b for _, b in t.recomputes[i]] if t.recomputes else []) for t in traces])


def _fit_layer(traces: list, checks: list, i: int, kind: str, offset: int) -> dict:
    saved = fit_sequence(f"layer {i}", [t.layers[i] for t in traces], [t.layers[i] for t in checks], kind, offset)
    backward = fit_sequence(f"layer {i} backward", [t.backwards[i] for t in traces],
                            [t.backwards[i] for t in checks], kind, offset)
    forward = fit_sequence(f"layer {i} forward", [t.forwards[i] for t in traces], [t.forwards[i] for t in checks],
                           kind, offset)
    recompute = fit_sequence(f"layer {i} recompute, weight copies as made", [t.recomputes[i] for t in traces],
                             [t.recomputes[i] for t in checks], kind, offset) \
        if all(t.recomputes for t in traces + checks) else []  # (a Trace built without it)
    accumulating = fit_sequence(f"layer {i} backward, gradients accumulated", [t.accumulating[i] for t in traces],
                                [t.accumulating[i] for t in checks], kind, offset)
    inflight = fit_sequence(f"layer {i} forward in flight", [t.inflight[i] for t in traces],
                            [t.inflight[i] for t in checks], kind, offset) \
        if all(t.inflight for t in traces + checks) else []  # (a Trace built without it)
    sdpa = {place: fit_sequence(f"layer {i} {place}", [getattr(t, attr)[i] for t in traces],
                                [getattr(t, attr)[i] for t in checks], kind, offset)
            if all(getattr(t, attr) and getattr(t, attr)[i] for t in traces + checks) else []
            for place, attr in (("sdpa", "sdpa"), ("sdpa accumulating", "sdpa_accumulating"))}
    return {"layer": [(LAYER_INDEX.sub(".N.", n, count=1), list(c)) for n, c in saved],
            "backward": [(n, list(c)) for n, c in peak_candidates(backward)],
            "forward": [(n, list(c)) for n, c in peak_candidates(forward)],
            "recompute": [(n, list(c)) for n, c in peak_candidates(recompute)],
            "accumulating": [(n, list(c)) for n, c in peak_candidates(accumulating)],
            "inflight": [(n, list(c)) for n, c in peak_candidates(inflight)],
            **{place: [(n, list(c)) for n, c in fit] for place, fit in sdpa.items()}}


def table_key(table: dict) -> tuple:
    return (tuple((saver(n), tuple(c)) for n, c in table["layer"]),
            *(tuple(sorted(tuple(c) for _, c in table.get(w, [])))
              for w in ("backward", "forward", "accumulating", "recompute")))


def group(traces: list, checks: list, kind: str, offset: int) -> tuple[list[dict], list[int]]:
    """The kinds ({"layer": saved tensors, "backward" and "forward": peak candidates}, fitted) and each layer's
    kind."""
    fitted: dict[str, dict] = {}
    kinds: list[dict] = []
    index: dict[tuple, int] = {}
    layer_kinds = []
    for i in range(len(traces[0].layers)):
        raw = _raw_key(traces + checks, i)
        if raw not in fitted:
            fitted[raw] = _fit_layer(traces, checks, i, kind, offset)
        key = table_key(fitted[raw])
        if key not in index:
            index[key] = len(kinds)
            kinds.append(fitted[raw])
        layer_kinds.append(index[key])
    return kinds, layer_kinds
