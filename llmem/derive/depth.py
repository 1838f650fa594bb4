"""Tracing fewer decoder layers: a prefix of the layer pattern that holds every layer role of the full model.

What a decoder layer saves and how its backward runs depends on its settings in the config's per-layer lists
(`layer_types`: sliding-window or full attention; any list with one entry per layer), on the modules its
`__init__` picks from the layer index (DeepSeek's dense first layers: its parameters, `layer_modules`) and, as
traced, on its place:
layer 0 (its backward frees what all layers share, e.g. the RoPE tables), the lowest layer of each setting (its
backward frees what only those layers share) and the last layer (its output gradient comes from the final norm).
A tensor two layers use is shared (`outer`), one only one layer uses is that layer's own, so a setting that has
two layers or more keeps two. `plan_depth` finds the shortest prefix of the full model with the same roles
(`role`), ending in the same setting as the full model; it is traced instead of the full depth, and `expand` gives
each full layer the kind of the prefix layer with its role, each held argument the full layers of those roles.
Only the model types of `VERIFIED` are traced shallower (their fits compared with full-depth traces to the byte,
names included: `scripts/check_depth.py`); any other is traced at full depth, since a per-layer rule neither the
config's lists nor the built modules show (e.g. a layer index test in a forward) would be missed. A traced name that
holds a prefix layer's module path (a tensor outside the layers first saved by that layer) is given the path of the
first full layer of its role (`expand`), as the full-depth trace names it. Pure Python: no torch.
"""

from __future__ import annotations

# model types whose decoder layers differ only by the config's per-layer lists and by the modules their
# `DecoderLayer.__init__` picks from the layer index; read in each modeling file (transformers 5.23): the layer index
# otherwise only picks cache entries, those lists, or (gpt2's scale_attn_by_inverse_layer_idx) a scalar. The modules
# picked show in the layer's parameters (`layer_modules`): a dense MLP below `first_k_dense_replace`
# (`modeling_deepseek_v2.py:427`, `modeling_deepseek_v3.py:492`, `modeling_glm4_moe.py:401`), in `mlp_only_layers`
# or off `decoder_sparse_step` (`modeling_qwen3_moe.py:308-309`)
VERIFIED = ("gemma3_text", "gpt2", "opt", "bloom", "falcon", "gpt_neox", "phi3", "gemma2", "olmo2", "granite",
            "starcoder2", "stablelm", "phi", "cohere", "smollm3", "mixtral", "gpt_oss", "qwen3_moe", "deepseek_v2",
            "deepseek_v3", "glm4_moe")


def layer_modules(params, layers: int) -> list[tuple]:
    """Each decoder layer's parameters as the model builds them (`ParamTensor`s of the meta-device inventory):
    (name within the layer, shape), e.g. a dense MLP's `mlp.down_proj.weight` where the expert layers have
    `mlp.experts.down_proj` — the layer-index rules of a modeling file's `__init__` that no per-layer list shows."""
    out: list[list] = [[] for _ in range(layers)]
    for p in params:
        if p.layer is not None and 0 <= p.layer < layers:
            out[p.layer].append((p.name.split(f".{p.layer}.", 1)[-1], tuple(p.shape)))
    return [(repr(sorted(modules)),) for modules in out]


def per_layer_settings(values: dict, layers: int) -> tuple[list[str], list[tuple]]:
    """The names of the config's per-layer lists (one entry per decoder layer) and each layer's entries."""
    keys = sorted(k for k, v in values.items() if isinstance(v, (list, tuple)) and len(v) == layers)
    return keys, [tuple(repr(values[k][i]) for k in keys) for i in range(layers)]


def role(settings: list[tuple], i: int) -> tuple:
    """Layer `i`'s role: its settings, whether it is layer 0, the lowest of its settings, the last layer."""
    return settings[i], i == 0, settings.index(settings[i]) == i, i == len(settings) - 1


def plan_depth(model_type: str, settings: list[tuple]) -> tuple[int, list[int]] | None:
    """(prefix depth, the prefix layer of each full layer's role), or None: trace every layer. `settings`: each
    layer's per-layer list entries and its modules (`per_layer_settings`, `layer_modules`)."""
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


def expand(fits: dict, mapping: list[int], paths: list[str] = ()) -> dict:
    """The prefix's fits for the full depth: each layer of the kind of its prefix layer, each held argument
    taken (each shared tensor saved) by the full layers whose prefix layers took (saved) it. `paths`: the prefix
    layers' module paths (`model.layers.2`), to name what the full-depth trace names after a full layer: each full
    layer gets its prefix layer's table with the path renamed to its own, grouped into kinds as
    `llmem.derive.kinds.group` does (a name holding the layer's own path, e.g. `model.decoder.layers.3: native_dropout`,
    makes a kind of its own there); a tensor outside the layers is named after the first full layer of the role of
    the prefix layer that first saved it; `checkpointed backward` is then per prefix layer, given to each kind."""
    def full(per_entry: list[list[int]]) -> list[list[int]]:
        return [[i for i, m in enumerate(mapping) if m in set(layers)] for layers in per_entry]

    out = fits | {"layer_kinds": [fits["layer_kinds"][m] for m in mapping], "held_layers": full(fits["held_layers"]),
                  "outer_layers": full(fits["outer_layers"])}
    if not paths:
        return out
    from llmem.derive.kinds import table_key

    first = {m: i for i, m in reversed(list(enumerate(mapping)))}
    outer = {p: _path(p, first[k]) for k, p in enumerate(paths) if k in first}
    out |= {place: _renamed(fits[place], outer) for place in ("outer", "final", "head", "held")}
    tables, index, layer_kinds, firsts = [], {}, [], []
    for i, m in enumerate(mapping):
        table = _renamed(fits["kinds"][fits["layer_kinds"][m]], {paths[m]: _path(paths[m], i)})
        key = table_key(table)
        if key not in index:
            index[key] = len(tables)
            tables.append(table)
            firsts.append(m)
        layer_kinds.append(index[key])
    out |= {"kinds": tables, "layer_kinds": layer_kinds}
    if "checkpointed backward" in fits:
        out["checkpointed backward"] = [fits["checkpointed backward"][m] for m in firsts]
    return out


def _path(path: str, layer: int) -> str:
    """A prefix layer's module path with the full layer's index: `model.layers.2`, 11 -> `model.layers.11`."""
    return path[:path.rindex(".") + 1] + str(layer) if "." in path else path


def _renamed(value, paths: dict[str, str]):
    """`value` (fits: dicts, lists, (name, coefficients) pairs) with each name under a path of `paths` renamed."""
    if isinstance(value, dict):
        return {k: _renamed(v, paths) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_renamed(v, paths) for v in value)
    if isinstance(value, str):
        for old, new in paths.items():
            if value.startswith((old + ".", old + ":")) or f" {old}." in value or f" {old}:" in value:
                return value.replace(old + ".", new + ".").replace(old + ":", new + ":")
    return value
