"""What the trace (`llmem.derive.trace`) reads off its recorder and model beyond the saved tensors: the decoder's
unsaved locals at the last layer's start, and the gradients' excess over their parameters."""

from __future__ import annotations


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
