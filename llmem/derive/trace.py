"""Trace one forward and backward of the real model on fake tensors: what autograd saves, and what one decoder
layer's backward allocates.

The model is `AutoModelForCausalLM.from_config` (never remote code) built under `FakeTensorMode` in the plan's
parameter dtype with the plan's attention implementation, in train mode, and run as the step runs it
(`model(input_ids=ids)`, under `torch.autocast` for mixed precision; backward outside it).

Saved tensors: every tensor autograd saves passes through `torch.autograd.graph.saved_tensors_hooks`' pack hook
(torch 2.13 `torch/autograd/graph.py`); it is recorded once per storage (a saved view keeps its whole storage
alive), named after the module that saved it and the aten op that allocated the storage, and placed where it lives:
one decoder layer, before the layers (embeddings, RoPE tables and anything several layers share), after them
(final norm, lm_head input), or after the lm_head. Parameters, buffers and autocast's weight copies (`_to_copy` of
a parameter to the autocast dtype; `llmem.components.autocast` counts those) are left out; a saved storage counts
while a node that saved it exists at the end of the forward (a storage freed before then starts a new entry if its
address comes back). The loss is not traced: `llmem.components.logits` models `ForCausalLMLoss`; backward starts
from the logits.

Layer backward: the allocation tracker of `llmem.simulate.tracker` records every allocation and free; a decoder
layer's backward runs from the moment the gradient of its output exists (a tensor hook on the output) to the moment
the gradient of its input exists (a hook on the input). `backwards` lists, per layer, the live bytes after each
event of that window, relative to its start, plus the output gradient itself; `backward` is the last layer's.
The parameters' and buffers' storages are known to the tracker before it starts, so a view of a weight first made
in backward (the `t()` of a Conv1D weight in its addmm's backward) counts no bytes.
`inflight` lists each layer's whole forward (pre-hook to forward hook) from 0: the moment its transients sit beside
every earlier layer's saved tensors (`Derived.forward_inflight_extra_bytes`), autocast's weight copies as made
(`windows.inflight_window`). `forwards` lists the same for each layer's forward, from its pre-hook to its last saved
tensor (what a checkpointed layer's recompute allocates before non-reentrant checkpointing stops it early), without
autocast's weight copies,
on top of what the layer's backward holds when it first unpacks a saved tensor — the moment the real checkpointed
layer's recompute starts (torch 2.13 `utils/checkpoint.py`, `_checkpoint_hook.unpack_hook`): the output gradient
and whatever the nodes before that one made (gpt-oss: `weighted_out[inv_perm].view(T, k, h).sum(1)`, whose
ViewBackward0 copies the expanded gradient to tokens × top_k × h before IndexBackward0 unpacks `inv_perm`).
`sdpa` is each layer's `backwards` when sdpa's backward kernel has returned (the inner dispatch mode notes the
tracker's event count then; `windows.at_event`).

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
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from llmem.derive import int8
from llmem.derive.trace_live import (
    Packed,
    first_forward_window,
    grad_excess,
    kept_returned,
    note_returned,
    unpacked,
    unsaved_locals,
)
from llmem.derive.windows import _window, at_event, inflight_window

PRE, POST, HEAD = "pre", "post", "head"
_PLAIN = (torch.Tensor, torch.nn.Parameter)


@dataclass
class Trace:
    """One forward and backward at (batch, seq): saved storages per place, in order of first saving."""

    layers: list[list[tuple[str, int]]]  # per decoder layer: (name, bytes)
    outer: list[tuple[str, int]]  # before the layers, or shared by several places
    final: list[tuple[str, int]]  # after the last layer, up to the lm_head's input
    head: list[tuple[str, int]]  # after the lm_head (on the logits)
    held: list[tuple[str, int]]  # tensors passed to the decoder layers besides hidden states, not saved
    backward: list[tuple[str, int]] = field(default_factory=list)  # last layer's backward: live bytes per event
    backwards: list[list[tuple[str, int]]] = field(default_factory=list)  # every layer's, as `backward`
    accumulating: list[list[tuple[str, int]]] = field(default_factory=list)  # every layer's, each weight gradient
    #                       added in place into its `.grad` (a later micro-step of --grad-accum, `_window`)
    forwards: list[list[tuple[str, int]]] = field(default_factory=list)  # every layer's forward: live bytes per event
    recomputes: list = field(default_factory=list)  # `forwards`, weight copies as made less all made (`_forwards`)
    inflight: list[list[tuple[str, int]]] = field(default_factory=list)  # every layer's whole forward, from 0
    held_layers: list[list[int]] = field(default_factory=list)  # per `held` entry: the layers it was passed to
    locals: list[tuple[str, int]] = field(default_factory=list)  # the decoder's locals: `trace_live.unsaved_locals`
    outer_layers: list[list[int]] = field(default_factory=list)  # per `outer` entry: the layers that saved it
    grad_excess: int = 0  # the `.grad`s beyond their parameters (TP: DTensor's embedding backward's Replicate)
    returns_probs: bool = False  # the decoder layers return b x heads x s x s tensors (`trace_live.note_returned`)
    returned: list[tuple[str, int]] = field(default_factory=list)  # `trace_live.first_forward_window`
    sdpa: list = field(default_factory=list)  # `backwards` at sdpa's kernel (`at_event`)
    sdpa_accumulating: list = field(default_factory=list)  # `accumulating` at the same


def _local(t):
    """The local tensor of a DTensor (TP's parameters and activations), else the tensor."""
    return getattr(t, "_local_tensor", t)


class _Allocations(TorchDispatchMode):
    """Which aten op allocated each storage, and which storages are autocast's copies of parameters."""

    def __init__(self, params: set[int], autocast_dtype: torch.dtype | None):
        super().__init__()
        self.params, self.origin, self.copies, self.matrices = params, {}, set(), set()
        self.autocast_dtype, self.keep = autocast_dtype, []
        self.forward = True  # False once backward starts: see `__torch_dispatch__`
        self.events, self.sdpa_backward_ends = None, []  # the tracker's events; their count after each sdpa backward
        self._alive: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t not in _PLAIN and not issubclass(t, FakeTensor) for t in types):
            return NotImplemented  # a wrapper subclass (DTensor): let it decompose into local-tensor ops
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not self.forward and name.startswith("_scaled_dot_product") and name.endswith("_backward"):
            self.sdpa_backward_ends.append(len(self.events))  # its q, k, v gradients: the tracker's last events
        if name == "bernoulli_":  # CPU dropout's noise, named in the tables
            self.origin[args[0].untyped_storage()._cdata] = "dropout noise"
        copy = (name == "_to_copy" and self.autocast_dtype is not None and isinstance(args[0], torch.Tensor)
                and args[0].untyped_storage()._cdata in self.params and isinstance(out, torch.Tensor)
                and out.dtype == self.autocast_dtype)  # autocast's cast of a weight (a model's own casts count)
        for i, t in enumerate(tree_leaves(out)):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st._cdata
                ref = self._alive.get(key)
                if ref is None or ref() is None:  # a new storage (an address can be reused after a free)
                    self.origin[key] = f"{name}[{i}]" if i else name  # e.g. native_layer_norm[1]: its mean
                    self._alive[key] = weakref.ref(st)
                if copy and self.forward:
                    self.copies.add(key)
                    if t.dim() >= 2:  # a weight matrix's (the walk's `autocast` terms count those alone)
                        self.matrices.add(key)
                    self.keep.append(st)  # alive to the end of the forward: no activation takes its address
        # In backward (a checkpointed layer's recompute) a copy is not kept: the frozen base's copies, saved by their
        # mm alone, go with their MmBackward0 as in the real step, before the attention core's backward
        return out


def build(config: dict, dtype_name: str, attn: str, lora=None, checkpointed: bool = False, tp: int = 1):
    """The model on fake CPU tensors; returns (fake mode, model, decoder layers, output embedding). `lora`: the
    LoRA fields (`llmem.derive.lora.trace_key`), whose PEFT model is traced as `llmem.runtime.lora.apply_method`
    builds it for the measured step. `checkpointed`: every decoder layer checkpointed (`use_reentrant=False`, as
    `llmem.runtime.session.enable_checkpointing`), for the layer backward's windows only (a checkpointed layer's
    own saved tensors do not pass the trace's pack hook). `tp` > 1: wrapped by the runtime's TP (`wrap`), inside
    the fake process group of `llmem.derive.tp.fake_group`."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    from llmem.derive.quant import preload
    from llmem.plan import TrainingPlan
    from llmem.runtime.model import decoder_layers, hf_config

    cfg = hf_config(config, TrainingPlan())
    preload(lora)  # --method qlora: bitsandbytes' import-time tensors made before the fake mode
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode, torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype_name), attn_implementation=attn,
                                                 trust_remote_code=False)
    model.config.use_cache = False
    if checkpointed:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if tp > 1:  # with LoRA: TP first, then PEFT on the sharded base (`llmem.runtime.lora_tp`)
        from llmem.derive.tp import wrap_tp

        with mode:
            model = wrap_tp(model, tp, lora=lora is not None)
    if lora is not None:
        from llmem.derive.lora import wrap

        with mode, torch.device("cpu"):
            model = wrap(model, lora, checkpointed)
    model.train()
    return mode, model, list(decoder_layers(model)), model.get_output_embeddings()


class _Recorder:
    """The module hooks and the pack hook of one trace. `checkpointed`: backward unpacks as a checkpointed layer's
    (`trace_live.unpacked`): the layer backward's windows of a checkpointed layer after its recompute."""

    def __init__(self, model, layers, head, params: set[int], tracker, autocast_dtype, checkpointed: bool = False):
        self.params, self.tracker, self.alloc = params, tracker, _Allocations(params, autocast_dtype)
        self.checkpointed = checkpointed
        self.alloc.events, self.place, self.stack, self.keep = tracker.events, PRE, [], []
        self.lora = hasattr(model, "peft_config")  # a PEFT model
        self.places: dict[int, list] = {}  # storage -> [[(place, weak ref to its _Packed)], name, bytes, weak ref]
        self.layer_args: dict[int, tuple[str, int]] = {}
        self.arg_layers: dict[int, list[int]] = {}  # storage of a layer argument -> the layers it was passed to
        self.inputs: dict[int, int] = {}  # storage of a layer's hidden-states input -> layer index
        self.windows: dict[int, list[int]] = {}  # layer -> event indices: its output gradient, its input gradient
        self.grad_outs: dict[int, int] = {}
        self.unpacks: list[int] = []  # backward: the event index at each saved tensor's unpack (`_trigger`)
        self.embedding_leaf: tuple[int, int] | None = None  # (storage, bytes), see `_leaf`
        self.forwards: dict[int, list[int]] = {}  # layer -> event indices: forward entered, last saved tensor packed
        self.forward_ends: dict[int, int] = {}  # layer -> event index at its forward hook (its output made)
        self.last, self.ids_bytes, self.entry_live = len(layers) - 1, 0, {}  # entry_live: `_enter`'s snapshot
        self.returned, self.kept_probs = {}, 0  # per layer its returned probabilities (`trace_live.note_returned`)
        names = {m: n for n, m in model.named_modules()}
        self.handles = [m.register_forward_pre_hook(lambda mod, a: self.stack.append(names.get(mod, "")))
                        for m in model.modules()]
        self.handles += [m.register_forward_hook(lambda mod, a, o: (self.stack.pop(), None)[1])
                         for m in model.modules()]
        for i, layer in enumerate(layers):
            self.handles.append(layer.register_forward_pre_hook(self._enter(i), with_kwargs=True))
            self.handles.append(layer.register_forward_hook(self._leave(i)))
        if head is not None:
            self.handles.append(head.register_forward_hook(lambda *a: setattr(self, "place", HEAD)))
        embeddings = model.get_input_embeddings()
        if embeddings is not None:
            self.handles.append(embeddings.register_forward_hook(self._leaf))

    def _leaf(self, module, args, output) -> None:
        """PEFT's input-require-grads hook (`enable_input_require_grads`: `output.requires_grad_(True)`, registered
        before this one) makes the frozen embeddings' output a leaf that requires grad: its AccumulateGrad node keeps
        it until backward has run, a tensor no pack hook sees."""
        if isinstance(output, torch.Tensor) and output.is_leaf and output.requires_grad:
            self.embedding_leaf = (output.untyped_storage()._cdata, output.untyped_storage().nbytes())

    def _mark(self, grad, layer: int, first: bool):
        if first:
            self.grad_outs[layer] = grad.untyped_storage().nbytes()
        self.windows.setdefault(layer, []).append(len(self.tracker.events))

    def _enter(self, i: int):
        def hook(module, args, kwargs):
            self.place = i
            self.forwards[i] = [len(self.tracker.events)]
            leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if leaves:
                self.inputs[leaves[0].untyped_storage()._cdata] = i
                if leaves[0].requires_grad:
                    leaves[0].register_hook(lambda g: self._mark(g, i, False))
            for t in leaves[1:]:
                st = t.untyped_storage()
                self.keep.append(st)  # alive to the end of the trace: no later storage takes its address
                self.layer_args.setdefault(st._cdata, (f"layer argument ({t.dim()}-d {t.dtype})", st.nbytes()))
                self.arg_layers.setdefault(st._cdata, []).append(i)
            if i == self.last:  # what the walk counts apart is told now: a storage freed later leaves its address
                self.kept_probs = kept_returned(self, i) if self.alloc.forward else self.kept_probs  # not a recompute's
                self.entry_live = {k: (n, ref) for k, (block, n, ref) in self.tracker._live.items()  # to others
                                   if block >= 0 and k not in self.layer_args and k not in self.alloc.copies}
        return hook

    def _leave(self, i: int):
        def hook(module, args, output):
            self.place = POST
            self.forward_ends[i] = len(self.tracker.events)
            note_returned(self, i, output)
            out = next(t for t in tree_leaves(output) if isinstance(t, torch.Tensor))
            out.register_hook(lambda g: self._mark(g, i, True))
        return hook

    def pack(self, t):
        st = _local(t).untyped_storage()
        key = st._cdata
        if key in self.params or (key in self.alloc.copies and not (self.lora and isinstance(self.place, int))):
            return t  # under LoRA a layer's saved weight copies are in its table (`llmem.derive.lora`)
        entry = self.places.get(key)
        if entry is None or entry[3]() is None:  # new, or the address of a freed storage (its nodes are gone)
            self.places.pop(key, None)  # listed in order of first saving
            entry = self.places[key] = [[], "", st.nbytes(), weakref.ref(st)]
        if isinstance(self.place, int):  # a recompute stops here (`torch.utils.checkpoint`'s early stop)
            self.forwards[self.place][1:] = [len(self.tracker.events)]
        packed = Packed(t)
        entry[0].append((self.place, weakref.ref(packed)))
        if not entry[1]:
            entry[1] = f"{self.stack[-1] if self.stack else 'model'}: {self.alloc.origin.get(key, 'input')} {t.dtype}"
        return packed


    def unpack(self, packed):
        if not self.alloc.forward:
            self.unpacks.append(len(self.tracker.events))
        return unpacked(packed, self.checkpointed and not self.alloc.forward)


def trace(built, batch: int, seq: int, mixed_dtype: str | None, cuda: bool = False, ckpt: bool = False) -> Trace:
    """One forward and backward at (batch, seq) of a model from `build`; `mixed_dtype`: under `torch.autocast`;
    `cuda`: CUDA's branches (dropout, `simulate.patches.cuda_kernel_choices`); `ckpt`: `_Recorder.checkpointed`."""
    import transformers.masking_utils as masking

    from llmem.derive.quant import default_gemm_4bit
    from llmem.plan import TrainingPlan
    from llmem.simulate.patches import cuda_kernel_choices, untracked_sharding_propagation
    from llmem.simulate.stand_ins import stand_ins
    from llmem.simulate.tracker import AllocationTracker

    mode, model, layers, head = built
    params = {_local(t).untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())}
    tracker = AllocationTracker()
    tracker.stand_ins = stand_ins()  # e.g. grouped MoE experts' `aten._grouped_mm`, whose meta wants bf16
    for t in (*model.parameters(), *model.buffers()):  # made before the tracker: known, never allocations (a
        tracker.outside_allocator(_local(t).untyped_storage())  # weight first viewed in backward, `_grouped_mm`)
    rec = _Recorder(model, layers, head, params, tracker, getattr(torch, mixed_dtype) if mixed_dtype else None, ckpt)
    autocast = torch.autocast("cpu", dtype=getattr(torch, mixed_dtype)) if mixed_dtype else contextlib.nullcontext()
    kernels = cuda_kernel_choices(TrainingPlan(device="cuda" if cuda else "cpu"))
    try:
        with mode, mock.patch.object(masking, "find_packed_sequence_indices", lambda position_ids: None), \
                untracked_sharding_propagation(tracker), kernels, default_gemm_4bit(model), \
                int8.held_inputs(model, rec):
            ids = torch.zeros((batch, seq), dtype=torch.long)
            rec.ids_bytes = ids.untyped_storage().nbytes()
            with tracker, rec.alloc:
                with autocast, torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack):
                    logits = model(input_ids=ids).logits
                # what the graph keeps for backward (--quant int8: and the inputs its nodes keep, `derive.int8`)
                out = int8.sorted_with_held(rec, lambda: _sort(rec, ids.untyped_storage()._cdata, len(layers)))
                out.locals = unsaved_locals(rec)
                copies = {tracker._live[k][0] for k in rec.alloc.copies if k in tracker._live}
                matrices = {tracker._live[k][0] for k in rec.alloc.matrices if k in tracker._live}
                out.returned, out.returns_probs = first_forward_window(rec, tracker.events, copies, matrices)
                rec.keep.clear()  # backward frees what it frees in the real step
                rec.alloc.keep.clear()
                rec.alloc.forward = False
                logits.backward(torch.ones_like(logits))
            out.grad_excess = grad_excess(model)
            grads = {tracker._live[k][0] for k in (_local(p.grad).untyped_storage()._cdata
                                                   for p in model.parameters() if p.grad is not None)
                     if k in tracker._live}
            model.zero_grad(set_to_none=True)
    finally:
        for h in rec.handles:
            h.remove()
    out.backwards = [_window(tracker.events, rec.windows.get(i, []), rec.grad_outs.get(i, 0))
                     for i in range(len(layers))]
    out.backward, out.accumulating = out.backwards[-1], [
        _window(tracker.events, rec.windows.get(i, []), rec.grad_outs.get(i, 0), in_place=grads)
        for i in range(len(layers))]
    out.sdpa, out.sdpa_accumulating = (at_event(lives, rec.windows, rec.alloc.sdpa_backward_ends)
                                       for lives in (out.backwards, out.accumulating))
    out.forwards, out.recomputes = _forwards(rec, tracker.events, out.backwards, copies, matrices)
    out.inflight = [inflight_window(tracker.events, [rec.forwards[i][0], rec.forward_ends[i]], copies, matrices,
                                    rec.lora)
                    if i in rec.forwards and i in rec.forward_ends else [("layer output gradient", 0)]
                    for i in range(len(layers))]
    return out


def _forwards(rec: _Recorder, events, backwards: list, copies: set, matrices: set) -> tuple[list, list]:
    """Per layer, its forward window from the recompute's trigger (`_trigger`) without autocast's copies of
    parameters (`Trace.forwards`), and the same with each copy counted from the event that makes it, less every
    weight-matrix copy the window makes (`Trace.recomputes`): the walk counts a recomputing layer's weight copies
    whole (`autocast.layer_weight_copy_bytes`), but a recompute holds only the copies made so far (phi's attention
    core, its peak, runs after the q, k, v copies and before dense's, fc1's and fc2's), biases' included."""
    forwards, recomputes = [], []
    for i in range(len(backwards)):
        window, trigger = rec.forwards.get(i, []), _trigger(rec, backwards[i], i)
        forwards.append(_window(events, window, trigger, copies)[1:])
        made = sum(events[k][2] for k in range(window[0], window[1]) if events[k][1] in matrices and events[k][2] > 0) \
            if len(window) >= 2 else 0
        recomputes.append([(n, b - made) for n, b in _window(events, window, trigger)[1:]])
    return forwards, recomputes


def _trigger(rec: _Recorder, backward: list[tuple[str, int]], layer: int) -> int:
    """What layer `layer`'s backward holds when it first unpacks a saved tensor (its output gradient included): the
    live bytes of its window (`backward`) at that event, where a checkpointed layer's recompute starts."""
    window = rec.windows.get(layer, [])
    if len(window) < 2:
        return rec.grad_outs.get(layer, 0)
    first = next((u for u in rec.unpacks if window[0] <= u <= window[1]), window[0])
    return backward[first - window[0]][1]


def _sort(rec: _Recorder, ids_key: int, n_layers: int) -> Trace:
    out = Trace([[] for _ in range(n_layers)], [], [], [], [])
    for key, (packs, name, nbytes, _) in rec.places.items():
        where = list(dict.fromkeys(place for place, ref in packs if ref() is not None))
        if not where:  # saved only by nodes already freed: no output's gradient reaches them
            continue
        if key == ids_key:
            name = "input_ids (labels)"
        if len(where) == 1 and isinstance(where[0], int):
            if rec.inputs.get(key) == where[0]:
                name = f"input (residual stream, layer input) {name}"
            out.layers[where[0]].append((name, nbytes))
        elif where == [POST]:
            out.final.append((name, nbytes))
        elif where == [HEAD]:
            out.head.append((name, nbytes))
        else:
            out.outer.append((name, nbytes))
            out.outer_layers.append(sorted(w for w in where if isinstance(w, int)))
    out.held = [v for k, v in rec.layer_args.items() if k not in rec.places]
    out.held_layers = [rec.arg_layers[k] for k in rec.layer_args if k not in rec.places]
    if not any(name == "input_ids (labels)" for name, _ in out.outer):  # a frozen embedding saves none: the batch's
        out.outer, out.outer_layers = [*out.outer, ("input_ids (labels)", rec.ids_bytes)], [*out.outer_layers, []]
    leaf = rec.embedding_leaf
    if leaf is not None and leaf[0] not in rec.places and rec.inputs.get(leaf[0]) != 0:  # not layer 0's input
        out.outer.append(("embedding output (a leaf that requires grad, kept by its AccumulateGrad)", leaf[1]))
        out.outer_layers.append([])
    return out
