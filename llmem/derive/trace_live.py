"""What the trace (`llmem.derive.trace`) reads off its recorder and model beyond the saved tensors: the decoder's
unsaved locals at the last layer's start, and the gradients' excess over their parameters."""

from __future__ import annotations


class Packed:
    """What the trace's pack hook hands autograd: the saved tensor, referenced by its node alone, so a weak reference
    tells whether the node still exists at the end of the forward. A node no output reaches is freed then, with what
    it saved (DeepSeek-V3's group-limited routing: the group top-k's indices only feed a mask); not counted."""

    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


def unpacked(packed, checkpointed: bool = False):
    """The saved tensor. `checkpointed`: handed over as a checkpointed layer's recomputed tensor is — torch 2.13
    `utils/checkpoint.py:1205-1207` (`_checkpoint_hook.unpack_hook`) drops its handle, so the node's locals alone
    hold it and it is freed when the node returns, before the engine's `validate_outputs` casts the node's outputs
    (torch/csrc/autograd/engine.cpp `call_function`; the saved variables of a node not checkpointed go later, in
    `release_variables`). DeepSeek-V3 in bf16: `proj_out * weights` (fp32 routing weights), whose gradient for the
    bf16 `proj_out` is cast from fp32; the plain window held `proj_out` beside the cast, +32,752 B on the
    checkpointed layer's backward (docs/notes/2026-11-28-deepseek-v3-ckpt-bf16.md)."""
    if not isinstance(packed, Packed):
        return packed
    t = packed.t
    if checkpointed:
        packed.t = None
    return t


def _local(t):
    """The local tensor of a DTensor (TP's parameters and activations), else the tensor."""
    return getattr(t, "_local_tensor", t)


def _saved_storage(rec, key: int, storage) -> bool:
    """Whether `storage` (at address `key`) is a saved tensor a node alive at the end of the forward holds."""
    from llmem.derive.int8 import live_keys

    if storage is not None and live_keys(rec).get(key) is storage:  # an 8-bit Linear's node keeps it
        return True
    entry = rec.places.get(key)
    return (entry is not None and storage is not None and entry[3]() is storage
            and any(ref() is not None for _, ref in entry[0]))


def unsaved_locals(rec) -> list[tuple[str, int]]:
    """What is alive when the last decoder layer's forward starts beyond what the walk counts there (the saved
    tensors, the layer arguments, autocast's weight copies, the parameters): the decoder forward's unsaved locals,
    e.g. the embeddings' output that `inputs_embeds` keeps until the model's forward returns where no op of layer 0
    saves it (LoRA: layer 0's input needs no gradient; transformers 5.23 `modeling_falcon.py` FalconModel.forward,
    `modeling_llama.py` LlamaModel.forward), or the last layer's input where that layer does not save it. One
    summed entry (its parts may differ between batch sizes, the sum is fitted)."""
    leaf = rec.embedding_leaf[0] if rec.embedding_leaf is not None else None  # counted in `outer` (`trace._sort`)
    total = sum(nbytes for key, (nbytes, ref) in rec.entry_live.items()
                if key != leaf and not _saved_storage(rec, key, ref()))
    return [("decoder locals: unsaved tensors alive at the last layer's start", total)]


def grad_excess(model) -> int:
    """The bytes by which the parameters' local gradients exceed the local parameters: under TP with the model's
    own plan the vocab-sharded embedding's gradient comes back Replicate, the whole vocabulary on every rank."""
    return sum(max(0, _local(p.grad).untyped_storage().nbytes() - _local(p).untyped_storage().nbytes())
               for p in model.parameters() if p.grad is not None)


def note_returned(rec, layer: int, output) -> None:
    """At decoder layer `layer`'s forward hook: the batch x heads x seq x seq tensors it returns beside its hidden
    states (its eager attention probabilities: transformers 5.23 `GPTJBlock.forward` `return hidden_states,
    attn_weights`; codegen, gpt_neo, mpt alike), weakly referenced by storage."""
    import weakref

    import torch

    if not isinstance(output, tuple) or not isinstance(output[0], torch.Tensor) or output[0].dim() != 3:
        return
    b, s = output[0].shape[:2]
    probs = [t for t in output[1:] if isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[0] == b
             and t.shape[-1] == t.shape[-2] == s]
    rec.returned[layer] = [(weakref.ref(t.untyped_storage()), t.untyped_storage().nbytes()) for t in probs]


def kept_returned(rec, layer: int) -> int:
    """At decoder layer `layer`'s pre-hook: the bytes of what layer `layer - 1` returned beside its hidden states
    that are still alive. In the checkpointed program no node saves them (torch 2.13 `utils/checkpoint.py`: the
    non-reentrant pack hook keeps a holder), so what holds them is the model's loop (`outputs = block(...)` until the
    next block returns; `all_self_attentions` only under output_attentions)."""
    return sum(n for ref, n in rec.returned.get(layer - 1, []) if ref() is not None)


def first_forward_window(rec, events, copies: set, matrices: set) -> tuple[list[tuple[str, int]], bool]:
    """The last decoder layer's first forward (pre-hook to forward hook, from 0: `windows.inflight_window`), before
    a checkpointed layer's recompute in backward moves the hooks' marks, after the bytes kept of the previous layer's
    return at its start (`kept_returned`): the table `Trace.returned`; and whether any layer returned probabilities
    (`Trace.returns_probs`)."""
    from llmem.derive.windows import inflight_window

    last, returns = rec.last, any(rec.returned.values())
    if last not in rec.forwards or last not in rec.forward_ends:
        return [], returns
    window = inflight_window(events, [rec.forwards[last][0], rec.forward_ends[last]], copies, matrices, rec.lora)
    return [("previous layer's returned probabilities, kept", rec.kept_probs), *window], returns
