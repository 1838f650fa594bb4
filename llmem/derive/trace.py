"""Trace one forward of the real model on fake tensors and record what autograd saves for backward.

The model is `AutoModelForCausalLM.from_config` (never remote code) built under `FakeTensorMode` in the plan's
parameter dtype with the plan's attention implementation, in train mode, and run as the step runs it
(`model(input_ids=ids)`, under `torch.autocast` for mixed precision). Every tensor autograd saves passes through
`torch.autograd.graph.saved_tensors_hooks`' pack hook (torch 2.13 `torch/autograd/graph.py`); it is recorded once
per storage (a saved view keeps its whole storage alive), named after the module that saved it and the aten op that
allocated the storage, and placed where it lives: one decoder layer, before the layers (embeddings, RoPE tables and
anything several layers share), after them (final norm, lm_head input), or after the lm_head (logit softcapping).
Parameters, buffers and autocast's weight copies (`_to_copy` of a parameter; `llmem.components.autocast` counts
those) are left out. The loss is not traced: `llmem.components.logits` models `ForCausalLMLoss`.

transformers 5.23 `masking_utils.find_packed_sequence_indices` cannot read a fake tensor's values, so under fake
tensors it reports packed sequences and the sdpa path builds an explicit mask the real step never builds; the trace
answers as the real step's inputs do (one sequence per row: `None`).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

PRE, POST, HEAD = "pre", "post", "head"
DROPOUT_OPS = ("bernoulli", "bernoulli_", "native_dropout")


@dataclass
class Trace:
    """One forward at (batch, seq): saved storages per place, in order of first saving."""

    layers: list[list[tuple[str, int]]]  # per decoder layer: (name, bytes)
    outer: list[tuple[str, int]]  # before the layers, or shared by several places
    final: list[tuple[str, int]]  # after the last layer, up to the lm_head's input
    head: list[tuple[str, int]]  # after the lm_head (on the logits)
    held: list[tuple[str, int]]  # tensors passed to the decoder layers besides hidden states, not saved
    dropout: bool = False  # a dropout op ran
    ops: dict = field(default_factory=dict)


class _Allocations(TorchDispatchMode):
    """Which aten op allocated each storage, and which storages are autocast's copies of parameters."""

    def __init__(self, params: set[int]):
        super().__init__()
        self.params, self.origin, self.copies, self.dropout = params, {}, set(), False
        self._alive: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.dropout |= name in DROPOUT_OPS
        copy = (name == "_to_copy" and isinstance(args[0], torch.Tensor)
                and args[0].untyped_storage()._cdata in self.params)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st._cdata
                ref = self._alive.get(key)
                if ref is None or ref() is None:  # a new storage (an address can be reused after a free)
                    self.origin[key], self._alive[key] = name, weakref.ref(st)
                if copy:
                    self.copies.add(key)
        return out


def build(config: dict, dtype_name: str, attn: str):
    """The model on fake CPU tensors; returns (fake mode, model, decoder layers, output embedding)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    from llmem.runtime.model import decoder_layers, hf_config

    cfg = hf_config_for(config, hf_config)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode, torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype_name), attn_implementation=attn,
                                                 trust_remote_code=False)
    model.config.use_cache = False
    model.train()
    return mode, model, list(decoder_layers(model)), model.get_output_embeddings()


def hf_config_for(config: dict, hf_config):
    from llmem.plan import TrainingPlan

    return hf_config(config, TrainingPlan())


def trace(built, batch: int, seq: int, mixed_dtype: str | None) -> Trace:
    """One forward at (batch, seq) of a model from `build`; `mixed_dtype` runs it under `torch.autocast`."""
    mode, model, layers, head = built
    params = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())}
    where = {"place": PRE}
    places: dict[int, list] = {}  # storage -> [places saved in, name, bytes]
    layer_args: dict[int, tuple[str, int]] = {}
    hidden_inputs: dict[int, int] = {}  # layer index -> storage of its hidden-states input
    keep: list = []
    names = {m: n for n, m in model.named_modules()}
    stack: list[str] = []
    handles = []

    def enter(i):
        def hook(module, args, kwargs):
            where["place"] = i
            leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if leaves:
                hidden_inputs[i] = leaves[0].untyped_storage()._cdata
            for t in leaves[1:]:
                st = t.untyped_storage()
                keep.append(st)  # alive to the end of the trace: no later storage takes its address
                layer_args.setdefault(st._cdata, (f"layer argument ({t.dim()}-d {t.dtype})", st.nbytes()))
        return hook

    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(enter(i), with_kwargs=True))
        handles.append(layer.register_forward_hook(lambda *a: where.update(place=POST)))
    if head is not None:
        handles.append(head.register_forward_hook(lambda *a: where.update(place=HEAD)))
    for m in model.modules():
        handles.append(m.register_forward_pre_hook(lambda mod, a: stack.append(names.get(mod, ""))))
        handles.append(m.register_forward_hook(lambda mod, a, o: (stack.pop(), None)[1]))
    alloc = _Allocations(params)

    def pack(t):
        st = t.untyped_storage()
        key = st._cdata
        if key in params or key in alloc.copies:
            return t
        entry = places.setdefault(key, [[], "", st.nbytes()])
        if where["place"] not in entry[0]:
            entry[0].append(where["place"])
        if not entry[1]:
            entry[1] = f"{stack[-1] if stack else 'model'}: {alloc.origin.get(key, 'input')} {t.dtype}"
        return t

    import transformers.masking_utils as masking

    autocast = (torch.autocast("cpu", dtype=getattr(torch, mixed_dtype)) if mixed_dtype
                else contextlib.nullcontext())
    try:
        with mode, mock.patch.object(masking, "find_packed_sequence_indices", lambda position_ids: None):
            ids = torch.zeros((batch, seq), dtype=torch.long)
            ids_key = ids.untyped_storage()._cdata
            with alloc, autocast, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                model(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    return _sort(places, layer_args, hidden_inputs, ids_key, len(layers), alloc.dropout)


def _sort(places, layer_args, hidden_inputs, ids_key, n_layers, dropout) -> Trace:
    out = Trace([[] for _ in range(n_layers)], [], [], [], [], dropout)
    inputs = {v: k for k, v in hidden_inputs.items()}
    for key, (where, name, nbytes) in places.items():
        if key == ids_key:
            name = "input_ids (labels)"
        if len(where) == 1 and isinstance(where[0], int):
            if inputs.get(key) == where[0]:
                name = f"input (residual stream, layer input) {name}"
            out.layers[where[0]].append((name, nbytes))
        elif where == [POST]:
            out.final.append((name, nbytes))
        elif where == [HEAD]:
            out.head.append((name, nbytes))
        else:
            out.outer.append((name, nbytes))
    out.held = [v for k, v in layer_args.items() if k not in places]
    return out
