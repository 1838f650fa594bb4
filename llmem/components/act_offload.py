"""`--activation-offload`: torchtune 0.6.1's activation offloading (`torchtune/training/_activation_offloading.py`)
as its recipes apply it, with activation checkpointing on every decoder layer (which they require,
`recipes/full_finetune_single_device.py:166-174`): `OffloadActivations()` around the model's forward, the output
projection opted out by `NoOpManager`, the loss computed after the forward (`llmem.runtime.act_offload`).

Every tensor autograd saves under the manager goes through its pack hook (`pack_tensor`, :133-200), which takes a new
id for it; one of at least `min_offload_size` = 1024 bytes that is not an `nn.Parameter` is copied into a new pinned
host tensor (`torch.empty_like(..., pin_memory=True, device="cpu")`, :171) and the device tensor is kept in the
forward stash until a later offloaded pack's id is 5 past its own (`max_fwd_stash_size=5`, :157-163). Under full
checkpointing the forward saves (torch 2.13, `torch/utils/checkpoint.py`: the checkpoint's own hooks take every save
inside a layer, so only what `_NoopSaveInputs` saves outside them reaches the manager):
  * the embedding's indices: the step's input ids (int64), which stay on the device as the step's input;
  * each decoder layer's input hidden states (`checkpointed_layer_bytes`), one pack per layer;
  * the final norm's: an RMSNorm's fp32 input (saved by pow and by mul: two packs, two host copies), its rsqrt
    (by rsqrt and by mul: two), the normalized product cast back (by the weight's mul; the weight a Parameter).
The final norm's five packs come last, so at the end of forward the stash holds exactly its saved tensors: the
device keeps `final_norm_saved` (with the lm_head's input, saved under the NoOpManager) and the outer tensors (ids,
RoPE cos and sin, which the checkpointed layers' recompute functions hold), and no layer's input. The loss, computed
outside the manager, keeps what it keeps without offload.

In backward (`unpack_tensor_with_streams`, :227-346) an offloaded tensor still in the forward stash is handed back
as is; any other is copied back to the device (`.to("cuda", non_blocking=True)` on the copy stream) and kept in the
backward stash until the hook of the next node that brings one back has run (:263-266, :334-338). The first node
to unpack drops the forward stash (:329-332). So while layer i recomputes and runs the first node of its backward
(down_proj's MmBackward0, whose saved input triggers the recompute), the device holds its input's copy and the
previous such node's copies: layer i + 1's input (for the last layer, the final norm's PowBackward0's fp32 input).
That previous copy is freed by the first node's hook, before the MLP's backward moment, so the layer moments hold
the recompute alone (`layers_below_bytes`). The embedding's backward brings the ids back beside layer 0's input
(`embedding_backward_bytes`); the end-of-backward callback frees the rest.
The CUDA caching allocator lowers `memory_allocated` when a block is freed even after `record_stream`
(`DeviceCachingAllocator::free`), so the stream events delay reuse, not the statistic.

Host memory: every offloaded pack's pinned copy, alive from its pack to its unpack: at the end of forward all of
them (`host_bytes`), each block rounded up to a power of two by the caching host allocator (`host_pinned_bytes`).
"""

from __future__ import annotations

from llmem.components import activations as act
from llmem.components.saved import FP32, _bytes
from llmem.errors import GAP, InputError
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec

MIN_OFFLOAD_BYTES = 1024  # OffloadActivations(min_offload_size=1024)
IDS_BYTES = 8  # int64 token ids
_DEVICE_OUTER = ("input_ids (labels)", "RoPE cos, sin")


def applies(plan: TrainingPlan) -> bool:
    return bool(plan.activation_offload)


def check_model(spec: ModelSpec, plan: TrainingPlan) -> None:
    """Modelled where the forward's saves outside the layers are the ids and a plain RMSNorm's (the llama-like
    families): a LayerNorm's, a unit-offset RMSNorm's, embedding dropout, position ids or a traced architecture's
    make other packs."""
    if not applies(plan):
        return
    family = spec.family
    other = spec.derived is not None or family.norm == "layer" or family.unit_offset_norm or family.embed_projection
    if not other:  # (a traced architecture is not traced for this: its own saves differ anyway)
        held = {s.name for s in act.checkpoint_held_saved(spec, plan)}
        other = any(s.name not in _DEVICE_OUTER and s.name not in held for s in act.outer_saved(spec, plan))
    if spec.is_moe and _bytes(plan)[1] < FP32:
        # simulated (tiny mixtral, vocabulary 64, bf16; one GPU, DDP, ZeRO-2, ZeRO-3 alike): the first layer's
        # backward holds 32,768 B = tokens x hidden x 2 more than these terms (-1.4 %), in fp32 nothing more (the
        # residual of the same plan without offload); which node keeps it is not traced yet
        raise InputError("activation-offload", "activation offloading is modelled for a mixture-of-experts model "
                         "with an fp32 residual stream only so far (in half precision its layer backward holds one "
                         "more tokens x hidden tensor: not modelled yet); use --precision fp32, or leave "
                         "--activation-offload off", GAP)
    if other:
        raise InputError("activation-offload", f"activation offloading is modelled for the llama-like families (an "
                         f"RMSNorm before the lm_head, nothing else saved outside the layers); {spec.model_type!r} "
                         "is not one yet: leave --activation-offload off", GAP)


def _offloaded(nbytes: int) -> int:
    """A pack's host copy: tensors under `min_offload_size` stay where they are."""
    return nbytes if nbytes >= MIN_OFFLOAD_BYTES else 0


def _final_norm_packs(spec: ModelSpec, plan: TrainingPlan) -> list[int]:
    """The final RMSNorm's packs (`LlamaRMSNorm.forward`): its fp32 input twice (pow, mul), its rsqrt twice (rsqrt's
    output, mul), the normalized product in the residual dtype once (the weight's mul)."""
    tokens, h = plan.batch_size * plan.seq_len, spec.hidden_size
    _, rb = _bytes(plan)
    return [tokens * h * FP32] * 2 + [tokens * FP32] * 2 + [tokens * h * rb]


def host_packs(spec: ModelSpec, plan: TrainingPlan) -> list[int]:
    """Every pinned host copy alive at the end of forward: the ids, each layer's input, the final norm's."""
    if not applies(plan):
        return []
    tokens = plan.batch_size * plan.seq_len
    packs = [tokens * IDS_BYTES] + [act.checkpointed_layer_bytes(spec, plan)] * spec.num_layers
    return [n for n in map(_offloaded, packs + _final_norm_packs(spec, plan)) if n]


def host_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The host copies and, beside them, each checkpointed layer's forward CPU RNG state (`torch.get_rng_state()`,
    stashed by the checkpoint until the layer's backward: a host tensor on every device)."""
    if not applies(plan):
        return 0
    return sum(host_packs(spec, plan)) + spec.num_layers * act.CPU_RNG_STATE_BYTES


def layers_below_bytes(spec: ModelSpec, plan: TrainingPlan, layer: int) -> int:
    """What the layers below layer `layer` hold on the device during its backward: nothing, their inputs are on the
    host. (The previous node's copy in the backward stash, layer `layer` + 1's input, is freed by the hook of the
    layer's first node, down_proj's MmBackward0, before its MLP's backward moment.)"""
    return 0


def embedding_backward_bytes(spec: ModelSpec, plan: TrainingPlan) -> tuple[int, int]:
    """(during the embedding's backward, after it): the ids' copy beside layer 0's input copy, then the ids' copy
    alone until the end-of-backward callback."""
    ids = _offloaded(plan.batch_size * plan.seq_len * IDS_BYTES)
    return ids + _offloaded(act.checkpointed_layer_bytes(spec, plan)), ids


def host_pinned_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The pinned blocks behind the host copies: each rounded up to a power of two (`CachingHostAllocator.h`, as
    `offload.host_pinned_bytes`)."""
    return sum(1 << (n - 1).bit_length() for n in host_packs(spec, plan))
