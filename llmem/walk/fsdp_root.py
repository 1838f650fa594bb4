"""FSDP2's root at the end of backward: its post-backward's copy-in of the root's unsharded gradients into the
reduce-scatter input, then the collective itself (`llmem.walk.fsdp` walks them, after the embedding's backward)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmem.components import communication as comm
from llmem.components import lora
from llmem.components import lora_copies_fsdp as copies
from llmem.components.sharding import local_numel
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec, per_spec
from llmem.walk.phase import Phase, moment

if TYPE_CHECKING:
    from llmem.walk.fsdp import FsdpTerms


def root_copy_in_moment(w: FsdpTerms, held: dict[str, int]) -> Phase:
    """The root's post-backward before its collective: `foreach_reduce` allocates `reduce_scatter_input` (reduce
    dtype) and copies every unsharded gradient of the root into it; only then does `unsharded_grads.clear()` free
    them (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:581-587). So each root gradient (param_dtype;
    LoRA: the root's adapters) is alive beside the whole input — above the collective's moment when the root's
    gradients outweigh its output shard and the lm_head's gradient (an untied embedding and lm_head)."""
    spec, plan, cp = w.spec, w.plan, w.cp
    unsharded = sum(local_numel(p, cp) for p in spec.outer_params) * cp.precision.param_bytes
    if lora.is_lora(plan):
        unsharded = _root_lora_gradient_bytes(w)
    name = "backward end (root reduce-scatter copy-in)"
    held[name] = sum(w.sharded_layer) * w.resident
    return moment(name, **w.persistent, logits=w.logits, gradients=held[name] + unsharded,
                  communication=comm.root_reduce_scatter_input_bytes(spec, plan)
                  + comm.shard_dim1_reduce_bytes(spec, plan, root=True)
                  + comm.chunk_cat_padding_bytes(spec, plan, root=True))


def root_reduce_moment(w: FsdpTerms, held: dict[str, int]) -> Phase:
    """The root's post-backward (final callback): its parameters are resharded before the reduce; of its unsharded
    gradients an untied lm_head weight's is still referenced during the collective (seen in every untied run; the
    holder of the reference is not pinned down), the others are freed after the copy-in — with tied embeddings the
    shared weight's too (its `.grad` is the tied sum's fresh tensor; measured on a tied gemma under ZeRO-3)."""
    root_sharded, head_unsharded, buffers = _root_reduce_terms(w.spec, w.plan)
    held["backward end (root reduce-scatter)"] = w.sharded_total * w.resident
    return moment("backward end (root reduce-scatter)", **w.persistent, logits=w.logits,
                  gradients=w.sharded_total * w.resident + root_sharded + head_unsharded, communication=buffers)


@per_spec("layout_key")
def _root_reduce_terms(spec: ModelSpec, plan: TrainingPlan) -> tuple[int, int, int]:
    """The root's sharded gradients, the lm_head's unsharded one still referenced, and the reduce-scatter's buffers."""
    from llmem.walk.fsdp import compute_plan

    cp = compute_plan(plan)
    root_sharded = sum(local_numel(p, plan) for p in spec.outer_params) * plan.precision.param_bytes
    head = next((p for p in spec.outer_params if "lm_head" in p.name or "embed_out" in p.name), None)
    head_unsharded = local_numel(head, cp) * cp.precision.param_bytes if head is not None else 0
    if lora.is_lora(plan):  # the root's frozen weights have no gradients; its adapters' (if any) are sharded
        root_sharded = lora.sharded_outer_adapter_bytes(spec, plan) + copies.sharded_copy_bytes(spec, plan)
        head_unsharded = copies.head_copy_unsharded_gradient_bytes(spec, plan)  # a trained lm_head copy's
    return root_sharded, head_unsharded, (comm.root_reduce_scatter_input_bytes(spec, plan)
                                          + comm.shard_dim1_reduce_bytes(spec, plan, root=True)
                                          + comm.reduce_scatter_scratch_bytes(spec, plan, root=True))


def embedding_copy_backward_moments(w: FsdpTerms, held: dict[str, int]) -> list[Phase]:
    """LoRA with a trained embedding copy (`--lora-modules-to-save embed_tokens`): the copy's backward,
    `embedding_dense_backward`, makes its dense V × h gradient (param_dtype, unsharded) while the tokens × h input
    gradient is alive, beside the lm_head copy's unsharded gradient (if trained) and the root's adapters'. As under
    full fine-tuning (`fsdp.embedding_backward_moments`) every layer's gradient is sharded by now, the root is still
    gathered and layer 0's reduce_scatter_input waits for the root's post-backward. Without an embedding copy the
    frozen embedding runs no backward: no moment."""
    spec, plan, cp = w.spec, w.plan, w.cp
    if not lora.trains_copy(spec, plan, "embed"):
        return []
    from llmem.components.gradients import embedding_input_gradient_bytes

    root_grads = _root_lora_gradient_bytes(w)  # the embedding copy's just made, the lm_head copy's
    name = "backward end (embedding copy)"
    held[name] = sum(w.sharded_layer) * w.resident
    return [moment(name, **w.persistent, logits=w.logits, gradients=held[name] + root_grads,
                   temporaries=embedding_input_gradient_bytes(spec, cp),
                   communication=comm.backward_gather_bytes(spec, plan, 0, own=False) + w.rs_ins[0])]


def _root_lora_gradient_bytes(w: FsdpTerms) -> int:
    """LoRA: the root group's unsharded gradients at the end of backward: its adapters' and PEFT's module copies'
    (`lora_copies_fsdp`)."""
    return lora.gathered_adapter_numel(w.spec, w.plan, None) * w.adapter_grad \
        + copies.unsharded_copy_gradient_bytes(w.spec, w.plan)
