"""`--grad-ckpt selective`: what torchtitan's op-level policy (`llmem.runtime.selective`) keeps of one decoder layer,
traced on fake tensors rather than listed per family.

The real model (`llmem.derive.trace.build`) runs one forward at the plan's (batch, seq), under autocast for mixed
precision, with a dispatch mode that asks the runtime's own policy (`selective.policy`, a fresh mm count, as in a
forward) about every op of decoder layer 0 and records the storages of the outputs it must save: what the
checkpoint keeps of the layer beside its input. A saved-tensors hook records the storages autograd itself would save
in that layer (what a recompute saves again), in order with the ops.

In backward the recompute takes each saved output out of the checkpoint's cache as it reaches the op (torch 2.13
`torch/utils/checkpoint.py`, `_CachedTorchDispatchMode` pops it), so an output autograd does not save dies there.
Non-reentrant checkpointing stops the recompute once the last tensor the forward packed is packed again (early stop,
the default), and autograd packs an op's inputs before its kernel runs: the saved outputs of ops dispatched after
the layer's last pack (llama: the down_proj mm, whose inputs are the last pack) are never taken out and stay cached
while the layer's backward runs. `SavedOutputs.extra` is those of them autograd does not save itself.

The trace runs on CPU, where SDPA dispatches `aten._scaled_dot_product_flash_attention_for_cpu` (output and
logsumexp, batch × heads × seq fp32); the CUDA flash op saves outputs of the same shapes, which the cuda profile
assumes.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass
from types import SimpleNamespace


@dataclass(frozen=True)
class SavedOutputs:
    """Bytes of one decoder layer: the policy's saved outputs (`total`), and of them those still cached through the
    layer's backward that autograd does not save itself (`extra`)."""

    total: int
    extra: int


class _LayerDone(Exception):
    """Raised by layer 0's forward hook: the trace stops there."""


def _record_mode():
    """A dispatch mode asking the runtime's policy about every op while `active`: the storages of the outputs it must
    save, their bytes and how many packs came before the op's dispatch."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from torch.utils.checkpoint import CheckpointPolicy

    from llmem.runtime.selective import policy, save_list

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.active = False
            self.policy = policy(defaultdict(int), save_list())
            self.saved: dict[int, tuple[int, int]] = {}  # storage -> (bytes, packs before the op's dispatch)
            self.packs = 0
            self.keep = []  # the outputs, alive to the end of the trace: no later storage takes their address

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            ctx = SimpleNamespace(is_recompute=False)
            if self.active and self.policy(ctx, func, *args, **kwargs) is CheckpointPolicy.MUST_SAVE:
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        st = t.untyped_storage()
                        self.saved.setdefault(st._cdata, (st.nbytes(), self.packs))
                        self.keep.append(t)
            return out

    return Record()


def _one_layer(config: dict) -> dict:
    """The config with one decoder layer (layer 0 is all the trace runs; its per-layer lists cut to match)."""
    out = dict(config)
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if key in out:
            out[key] = 1
    if isinstance(out.get("layer_types"), list):
        out["layer_types"] = out["layer_types"][:1]
    return out


def saved_outputs(config: dict, dtype_name: str, attn: str, mixed_dtype: str | None, batch: int,
                  seq: int) -> SavedOutputs:
    """Layer 0's saved outputs under the selective policy (see the module docstring)."""
    from unittest import mock

    import torch
    import transformers.masking_utils as masking

    from llmem.derive.trace import build

    mode, model, layers, _head = build(_one_layer(config), dtype_name, attn)
    rec, autograd_saved = _record_mode(), set()

    def pack(t):
        if rec.active:
            autograd_saved.add(t.untyped_storage()._cdata)
            rec.packs += 1
            rec.keep.append(t)  # alive to the end of the trace, as the graph would keep it
        return t

    def on(*_args, **_kw):
        rec.active = True

    def off(*_args, **_kw):
        rec.active = False
        raise _LayerDone  # the layers above and the head are not needed

    handles = [layers[0].register_forward_pre_hook(on), layers[0].register_forward_hook(off)]
    autocast = torch.autocast("cpu", dtype=getattr(torch, mixed_dtype)) if mixed_dtype else contextlib.nullcontext()
    try:
        with mode, mock.patch.object(masking, "find_packed_sequence_indices", lambda position_ids: None):
            ids = torch.zeros((batch, seq), dtype=torch.long)
            with autocast, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), rec:
                with contextlib.suppress(_LayerDone):
                    model(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    extra = sum(n for key, (n, packs) in rec.saved.items() if packs == rec.packs and key not in autograd_saved)
    return SavedOutputs(sum(n for n, _ in rec.saved.values()), extra)
