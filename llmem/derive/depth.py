"""Tracing fewer decoder layers: a prefix of the layer pattern that holds every layer role of the full model.

What a decoder layer saves and how its backward runs depends on its settings in the config's per-layer lists
(`layer_types`: sliding-window or full attention; any list with one entry per layer) and, as traced, on its place:
layer 0 (its backward frees what all layers share, e.g. the RoPE tables), the lowest layer of each setting (its
backward frees what only those layers share) and the last layer (its output gradient comes from the final norm).
A tensor two layers use is shared (`outer`), one only one layer uses is that layer's own, so a setting that has
two layers or more keeps two. `plan_depth` finds the shortest prefix of the full model with the same roles
(`role`), ending in the same setting as the full model; it is traced instead of the full depth, and `expand` gives
each full layer the kind of the prefix layer with its role, each held argument the full layers of those roles.
Only the model types of `VERIFIED` are traced shallower (their fits compared with full-depth traces); any other
is traced at full depth, since a per-layer rule the config's lists do not show (e.g. a layer index interval in
the modeling code) would be missed. Pure Python: no torch.
"""

from __future__ import annotations

VERIFIED = ("gemma3_text",)


def per_layer_settings(values: dict, layers: int) -> tuple[list[str], list[tuple]]:
    """The names of the config's per-layer lists (one entry per decoder layer) and each layer's entries."""
    keys = sorted(k for k, v in values.items() if isinstance(v, (list, tuple)) and len(v) == layers)
    return keys, [tuple(repr(values[k][i]) for k in keys) for i in range(layers)]


def role(settings: list[tuple], i: int) -> tuple:
    """Layer `i`'s role: its settings, whether it is layer 0, the lowest of its settings, the last layer."""
    return settings[i], i == 0, settings.index(settings[i]) == i, i == len(settings) - 1


def plan_depth(model_type: str, settings: list[tuple]) -> tuple[int, list[int]] | None:
    """(prefix depth, the prefix layer of each full layer's role), or None: trace every layer."""
    n = len(settings)
    if model_type not in VERIFIED:
        return None
    roles = [role(settings, i) for i in range(n)]
    for depth in range(2, n):
        prefix = settings[:depth]
        if prefix[-1] != settings[-1] or any(prefix.count(s) < min(2, settings.count(s)) for s in set(settings)):
            continue
        mine = {role(prefix, i): i for i in reversed(range(depth))}  # the lowest prefix layer of each role
        if set(mine) == set(roles):
            return depth, [mine[r] for r in roles]
    return None


def expand(fits: dict, mapping: list[int]) -> dict:
    """The prefix's fits for the full depth: each layer of the kind of its prefix layer, each held argument
    taken (each shared tensor saved) by the full layers whose prefix layers took (saved) it."""
    def full(per_entry: list[list[int]]) -> list[list[int]]:
        return [[i for i, m in enumerate(mapping) if m in set(layers)] for layers in per_entry]

    return fits | {"layer_kinds": [fits["layer_kinds"][m] for m in mapping], "held_layers": full(fits["held_layers"]),
                   "outer_layers": full(fits["outer_layers"])}
