"""QLoRA with an 8-bit base (`--quant int8`) on a traced architecture: the inputs its Linears keep, seen by the trace.

The trace quantizes the built fake model as the measured step does (`llmem.derive.quant.quantize`, `int8` tag:
transformers' `replace_with_bnb_linear` with `load_in_8bit`, then `Int8Params(...).to(device)`: int8 `CB`, fp32 `SCB`
made by bitsandbytes' fake `int8_vectorwise_quant`), and PEFT wraps each `Linear8bitLt` with its bnb 8-bit LoRA layer.
What one 8-bit Linear runs in training (bitsandbytes 0.50.2 `autograd/_functions.py`, `matmul`: `MatMul8bitFp` for a
CPU input, the program measured here):
- forward: `state.CB.data.to(A.dtype).mul_(state.SCB.unsqueeze(1).mul(1.0 / 127.0))`, the weight (out, in) in the
  compute dtype, then `F.linear`; the weight is freed on return. These are plain aten ops on fake tensors: the
  traced forward windows (the last layer's forward in flight, a checkpointed layer's recompute) hold them as the
  real step does.
- saved: nothing through `save_for_backward`; `ctx.A = A` keeps the Linear's input as an attribute of the autograd
  node, which no saved-tensors pack hook sees (`MatMul8bitLt`, the CUDA program, keeps `ctx.tensors = (None, subA,
  A)`: the same input, `subA` empty without outlier columns). The node lives while the graph does: autograd
  releases a node's saved tensors after its backward, not its attributes, so the input is held until the step's
  outputs are dropped, through the rest of the backward and the optimizer step, and a checkpointed layer's first
  forward keeps it too (checkpointing only packs saved tensors). A node is kept only when an input requires grad.
- backward: `state.CB.to(dtype, copy=True).mul_(...)` and `matmul(grad_output, CB)`: the dequantized weight beside
  the input gradient, inside the traced backward windows.
So the trace wraps `MatMul8bitFp.forward` (`held_inputs`) to note each node's input storage and a probe the node
owns (alive while the node is), and `mark` puts them into the layer tables: an input no pack hook saw is a saved
tensor of its layer of its own (`HELD` in its name); one the layer also saves (e.g. lora_A's input in fp32 without
dropout) is named with `SHARED`. `held_bytes` reads both back: the part of a layer's table that outlives the layer's
backward. Pure Python but `held_inputs`.
"""

from __future__ import annotations

import contextlib
import weakref

HELD = "8-bit Linear input (MatMul8bitFp ctx.A, held until the outputs are dropped)"
SHARED = " [also held by an 8-bit Linear's node]"


class _Probe:
    __slots__ = ("__weakref__",)


@contextlib.contextmanager
def held_inputs(model, rec):
    """While tracing an 8-bit base: `MatMul8bitFp.forward` also records, in `rec.int8_held` (storage address ->
    [place, probe ref, storage ref, bytes, name]), the input its node keeps as `ctx.A`."""
    rec.int8_held = {}
    if not getattr(getattr(model, "base_model", model), "is_loaded_in_8bit", False) and \
            not getattr(model, "is_loaded_in_8bit", False):
        yield
        return
    from unittest import mock

    from bitsandbytes.autograd._functions import MatMul8bitFp

    original = MatMul8bitFp.forward

    def forward(ctx, A, *args, **kwargs):
        out = original(ctx, A, *args, **kwargs)
        probe = ctx._llmem_probe = _Probe()  # dies with the node (`ctx`): at once when no input requires grad
        st = A.untyped_storage()
        entry = rec.int8_held.get(st._cdata)
        if entry is None or entry[2]() is not st:
            module = rec.stack[-1] if rec.stack else "model"
            rec.int8_held.pop(st._cdata, None)  # (an address freed and reused: listed in order of first use)
            rec.int8_held[st._cdata] = entry = [rec.place, [], weakref.ref(st), st.nbytes(),
                                                f"{module}: {HELD} {A.dtype}"]
        entry[1].append(weakref.ref(probe))
        return out

    with mock.patch.object(MatMul8bitFp, "forward", staticmethod(forward)):
        yield


def live_keys(rec) -> dict[int, object]:
    """The held inputs a node alive at the end of the forward keeps: storage address -> storage."""
    out = {}
    for key, (_, probes, st, _, _) in getattr(rec, "int8_held", {}).items():
        if st() is not None and any(p() is not None for p in probes):
            out[key] = st()
    return out


def sorted_with_held(rec, sort):
    """The trace's `_sort` (`sort()`: the saved storages per place) with the held inputs: marked where saved
    (`mark_shared`), added where not (`add_unsaved`)."""
    unsaved = mark_shared(rec)
    out = sort()
    add_unsaved(out, unsaved)
    return out


def mark_shared(rec) -> list[tuple[int, str, int]]:
    """Before the trace sorts its saved storages: the held inputs a pack hook also saw are named with `SHARED`; the
    others are returned as (layer, name, bytes) for `add_unsaved`."""
    unsaved = []
    leaf = rec.embedding_leaf[0] if rec.embedding_leaf is not None else None
    for key, st in live_keys(rec).items():
        place, _, _, nbytes, name = rec.int8_held[key]
        entry = rec.places.get(key)
        if key == leaf:  # the embeddings' output leaf (opt's project_in input): in `outer` already (`trace._sort`)
            continue
        if entry is not None and entry[3]() is st and any(ref() is not None for _, ref in entry[0]):
            entry[1] = (entry[1] or name.split(": ")[0]) + SHARED
        else:
            unsaved.append((place, name, nbytes))
    return unsaved


def add_unsaved(out, unsaved: list[tuple[int | str, str, int]]) -> None:
    """The held inputs no pack hook saw, appended (in order of first use) to the saved tensors of their layer, of
    the place after the layers (opt's `project_out`, whose input is the final norm's output) or, before the layers,
    of `outer` (opt's `project_in` when the embeddings' output requires grad)."""
    from llmem.derive.trace import POST, PRE

    for place, name, nbytes in unsaved:
        if isinstance(place, int):
            out.layers[place].append((name, nbytes))
        elif place == POST:
            out.final.append((name, nbytes))
        elif place == PRE:
            out.outer.append((name, nbytes))
            out.outer_layers.append([])
        else:  # after the lm_head, which stays unquantized: none
            raise RuntimeError(f"an 8-bit Linear after the lm_head: {name}")


def is_held(name: str) -> bool:
    return HELD in name or name.endswith(SHARED)


def held_bytes(saved) -> int:
    """Of a place's traced saved tensors (`Derived.layer_saved`, `final_saved`, `outer_saved`), those an 8-bit
    Linear's node keeps until the outputs are dropped."""
    return sum(s.bytes for s in saved if is_held(s.name))
