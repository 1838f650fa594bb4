"""`--no-sync`: the gradients the first K-1 micro-steps of `--grad-accum K` keep unsynchronized (accelerate 1.15
`Accelerator.accumulate` → `no_sync`, accelerator.py:1132-1178, 1255-1298; the HF Trainer, transformers 5.23
trainer.py:1896-1907).

FSDP2 (`set_requires_gradient_sync(False)`, torch 2.13 distributed/fsdp/_fully_shard/_fsdp_param_group.py:603-612):
a group's post-backward skips its reduce-scatter and leaves each parameter's gradient unsharded. If autograd made it
in another dtype than the group's reduce dtype (a MixedPrecisionPolicy: half gradients, fp32 reduce) it is cast into
`unsharded_accumulated_grad` (reduce dtype) and the half `.grad` freed (_fsdp_param.py:802-813
`to_accumulated_grad_if_needed`); later micro-steps add their half `.grad` into it at the post-backward and free it
(:815-821 `accumulate_unsharded_grad_if_needed`). Otherwise (fp32, pure half) the unsharded `.grad` itself stays and
AccumulateGrad adds into it in place. The synced last micro-step reduce-scatters the accumulated gradient (:623-626).

FSDP1 (`FullyShardedDataParallel.no_sync`, fully_sharded_data_parallel.py:1034-1071): `_post_backward_hook` returns
before its reduce-scatter (_runtime_utils.py:742-746), so each FlatParameter keeps its unsharded `.grad` (unpadded,
in the dtype backward made it: MixedPrecision's half param dtype) until the synced micro-step.

DDP (`DistributedDataParallel.no_sync`): the Reducer's hooks do nothing; the `.grad`s are the ones accumulation keeps
anyway (`gradients.gradient_bytes`), so no term changes.
"""

from __future__ import annotations

from llmem.components import lora
from llmem.components.gradients import head_gradient_bytes
from llmem.components.trainable import trainable
from llmem.plan import Engine, TrainingPlan
from llmem.spec import ModelSpec


def applies(plan: TrainingPlan) -> bool:
    """Whether `--no-sync` changes what is kept: under FSDP2 ZeRO-2/3 and FSDP1 (NO_SHARD included: its kept flat
    gradient is MixedPrecision's half one, not the fp32 `.grad` the synced micro-step casts it to). DDP and ZeRO-1
    keep the same `.grad`s either way (measured: identical peaks)."""
    from llmem.components.sharding import FSDP_SCHEMES

    return plan.no_sync and (plan.scheme in FSDP_SCHEMES or plan.engine is Engine.FSDP1)


def accumulated_elem_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Bytes per element of an accumulated unsharded gradient: FSDP2 the reduce dtype, which under a
    MixedPrecisionPolicy is float32 (llmem/runtime/parallel.py `_apply_fsdp`) and else the parameter dtype: the
    sharded parameter's bytes either way (LoRA: fp32 under the policy, else the adapters' dtype); FSDP1 the
    FlatParameter's unsharded dtype (MixedPrecision's half param dtype, else the parameter's)."""
    if plan.engine is Engine.FSDP1:
        return plan.precision.compute_bytes if plan.precision.is_mixed else plan.precision.param_bytes
    if lora.is_lora(plan):  # the adapters' own dtype (`lora.adapter_elem_bytes`), fp32 under the policy's reduce
        return 4 if plan.precision.is_mixed else lora.adapter_elem_bytes(spec)
    return plan.precision.param_bytes


def in_place(plan: TrainingPlan) -> bool:
    """Whether backward's new gradient is added into the accumulated one in place (AccumulateGrad): it is made in the
    accumulated dtype (no MixedPrecisionPolicy under FSDP2; always under FSDP1)."""
    return plan.engine is Engine.FSDP1 or not plan.precision.is_mixed


def _elem_bytes(spec: ModelSpec, cp: TrainingPlan) -> int:
    """Bytes per element of the compute plan's trained tensors (`trainable`): the adapters' under LoRA."""
    return lora.adapter_elem_bytes(spec) if lora.is_lora(cp) else cp.precision.param_bytes


def layer_accumulated_bytes(spec: ModelSpec, plan: TrainingPlan, cp: TrainingPlan, layer: int) -> int:
    """Decoder layer `layer`'s unsharded accumulated gradient: its trained elements (the compute plan's unsharded
    `.grad`s, `trainable.Trainable.layer`) × `accumulated_elem_bytes`."""
    return trainable(spec, cp).layer[layer] // _elem_bytes(spec, cp) * accumulated_elem_bytes(spec, plan)


def root_accumulated_bytes(spec: ModelSpec, plan: TrainingPlan, cp: TrainingPlan) -> int:
    """The root's (embeddings, final norm, lm_head: every trained tensor outside the layers) unsharded accumulated
    gradient, × `accumulated_elem_bytes`."""
    t = trainable(spec, cp)
    return (t.gradients - sum(t.layer)) // _elem_bytes(spec, cp) * accumulated_elem_bytes(spec, plan)


def accumulated_bytes(spec: ModelSpec, plan: TrainingPlan, cp: TrainingPlan) -> int:
    """Every unsharded accumulated gradient, alive from the first unsynced micro-step's post-backwards to the synced
    micro-step's reduce-scatters: the whole model's gradients on each GPU, not its share."""
    return sum(layer_accumulated_bytes(spec, plan, cp, k) for k in range(spec.num_layers)) \
        + root_accumulated_bytes(spec, plan, cp)


def root_new_bytes(spec: ModelSpec, cp: TrainingPlan) -> int:
    """The head's new unsharded gradients (the compute plan's `.grad`s of lm_head and the final norm) made in a
    later micro-step's backward."""
    return head_gradient_bytes(spec, cp)
