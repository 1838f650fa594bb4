"""What the plan's method trains and keeps: the substitution a method makes in the inventory.

Full fine-tuning trains every parameter of the model (`spec.params`, sharded per scheme, `llmem.components.sharding`)
in the plan's parameter dtype. LoRA freezes them and trains the fp32 adapters PEFT adds (`LoraLayer.update_layer`,
`llmem.components.lora`) and the copies of `--lora-modules-to-save`; QLoRA also substitutes the frozen base with its
4-bit or 8-bit Linears (`llmem.components.quant`). The categories read this inventory instead of asking the method:
`parameters` the base and the adapters, `gradients` the `.grad`s of the trained tensors by where backward makes them
(a decoder layer, the head, the input embedding). Gradient bytes are those the tensors have before any hook ran:
`--ddp-bucket-view` and `--optimizer-in-backward` free them at their hooks (`gradients.freed_at_hook`); CPU-offloaded
gradients (`--offload optimizer`, torchao `offload_gradients=True`) stay on the GPU only for tensors below
torchao's `minimal_size` (`offload.device_gradient_bytes`)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

from llmem.components import lora, offload, quant
from llmem.components.lora_copies_fsdp import sharded_copy_bytes
from llmem.components.sharding import FSDP_SCHEMES, local_numel, local_params, shard_summary
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec, per_spec


@dataclass(frozen=True)
class Trainable:
    """One rank's trained tensors under the plan's method, in bytes."""

    base: int  # the model's own parameters as they sit on the rank (full fine-tuning: the trained ones)
    adapters: int  # trained tensors beside the base (LoRA: the adapters, FSDP2: sharded with their layer)
    gradients: int  # every `.grad` once backward is done (FSDP2: the reduce-scattered shards)
    layer: tuple[int, ...]  # decoder layer l's `.grad`s (unsharded)
    later: tuple[int, ...]  # the `.grad`s of the layers after l, made before l's backward
    head: int  # the `.grad`s the head's backward makes: the tensors outside the layers but the input embedding's
    embedding: int  # the input embedding weight's `.grad` (LoRA: a trained copy's), made at the end of backward
    positional: int  # learned position embeddings' `.grad`s (GPT-2's wpe, OPT's embed_positions), made with it
    shared: int  # a trained weight the embedding and the lm_head share (tied): its `.grad` bytes; else 0
    embedding_backward: bool  # whether the input embedding (or its trained copy) runs backward at all


@per_spec("layout_key")
def trainable(spec: ModelSpec, plan: TrainingPlan) -> Trainable:
    """The plan's inventory: `_adapters` under LoRA and QLoRA, `_full` otherwise."""
    return _adapters(spec, plan) if lora.is_lora(plan) else _full(spec, plan)


def _full(spec: ModelSpec, plan: TrainingPlan) -> Trainable:
    """Every parameter trained, its `.grad` in the parameter dtype (fp32 under autocast: the cast's backward)."""
    pb, summary, outer = plan.precision.param_bytes, shard_summary(spec, plan), spec.outer_params
    positional = tuple(p for p in outer if "wpe" in p.name or "embed_positions" in p.name)
    own_embedding = outer[:1] if not spec.tie_word_embeddings else ()  # its gradient comes last
    made = [p for p in outer if p not in own_embedding + positional]
    if offload.offloads_gradients(plan):  # only the small tensors' stay; a tied weight's waits for the embedding's
        gradients = offload.device_gradient_bytes(spec.params, plan)
        later = tuple(_suffix([offload.device_gradient_bytes(spec.layer_params(k), plan)
                               for k in range(spec.num_layers)]))
        tied = [p for p in made if spec.tie_word_embeddings and p is outer[0]]
        head = sum(local_numel(p, plan) for p in tied) * pb + offload.device_gradient_bytes(
            [p for p in made if p not in tied], plan)
    else:
        gradients, head = summary.total * pb, sum(local_numel(p, plan) for p in made) * pb
        later = tuple(summary.later[k] * pb for k in range(spec.num_layers))
    embedding = local_numel(outer[0], plan) * pb if outer else 0  # (a middle pipeline stage has no outer tensor)
    return Trainable(
        base=local_params(spec, plan) * pb, adapters=0, gradients=gradients,
        layer=tuple(n * pb for n in summary.per_layer), later=later, head=head, embedding=embedding,
        positional=sum(local_numel(p, plan) for p in positional) * pb,
        shared=embedding if spec.tie_word_embeddings else 0, embedding_backward=True)


def _adapters(spec: ModelSpec, plan: TrainingPlan) -> Trainable:
    """LoRA / QLoRA: the frozen base (quantized under QLoRA) and the fp32 adapters, which alone get `.grad`s; the
    frozen embedding runs no backward unless a trained copy of it does (`--lora-modules-to-save`)."""
    if plan.scheme in FSDP_SCHEMES:  # FSDP2 shards the adapters with their layer
        adapters = sum(lora.sharded_layer_adapter_bytes(spec, plan)) + lora.sharded_outer_adapter_bytes(spec, plan) \
            + sharded_copy_bytes(spec, plan)  # the module copies: root parameters (`lora_copies_fsdp`)
    else:
        adapters = lora.adapter_bytes(spec, plan)
    if quant.is_qlora(plan):  # sharded packed codes and whole quant_states under FSDP2, else whole on every rank
        base = quant.fsdp_base_parameter_bytes(spec, plan) if plan.scheme in FSDP_SCHEMES \
            else quant.base_parameter_bytes(spec, plan)
    else:
        base = local_params(spec, plan) * plan.precision.param_bytes
    per_layer = [lora.layer_adapter_bytes(spec, plan, k) for k in range(spec.num_layers)]
    return Trainable(
        base=base, adapters=adapters, gradients=adapters, layer=tuple(per_layer), later=tuple(_suffix(per_layer)),
        head=lora.outer_adapter_bytes(spec, plan) + lora.copy_bytes(spec, plan, "head"),
        embedding=lora.copy_bytes(spec, plan, "embed"), positional=0, shared=0,
        embedding_backward=lora.trains_copy(spec, plan, "embed"))


def _suffix(per_layer: list[int]) -> list[int]:
    """later[l] = sum(per_layer[l + 1:])."""
    sums = list(accumulate(reversed(per_layer)))[::-1]  # sums[l] = sum(per_layer[l:])
    return sums[1:] + [0]
