"""DeepSpeed ZeRO-3 (`--engine deepspeed --zero 3`, deepspeed 0.19.0 `runtime/zero/stage3.py`,
`DeepSpeedZeroOptimizer_Stage3`, with `partition_parameters.py` and `partitioned_param_coordinator.py`): the sizes
of one rank's tensors, each a small function with its source line.

Every parameter is partitioned on its own (`partition_parameters.py` `_partition_param` :1657): its numel padded to
a multiple of W (`_aligned_size` :1580), rank r holds ceil(numel / W) elements (`ds_tensor`). b = bytes per element
of the module (2 under the bf16 section, 4 in fp32); the sum of the partitions is Sigma = sum ceil(n / W).
  lp partitions `_create_fp16_partitions_with_defragmentation` (stage3.py:753): every `ds_tensor` moved into one
               flat buffer (`defragment`), Sigma x b, persistent.
  master       `_create_fp32_partitions` (:915): the flat partition cast to fp32 and cloned (:1006), Sigma x 4, a
               tensor of its own even in fp32 (the alias branch at :996 compares a torch.device with the string
               `self.device`, never equal).
  states       the client optimizer over that one fp32 tensor (created at its first step): AdamW 2 x Sigma x 4.
  grad partitions `_setup_for_real_optimizer` (:633): `grad_partitions_flat_buffer`, Sigma elements of the
               gradient accumulation dtype (engine.py `get_data_types` :1252: the module's dtype unless
               `data_types.grad_accum_dtype` says), persistent; each reduced gradient partition is copied in
               (`partition_grads` :1699).
  bucket       `_setup_for_real_optimizer` (:624): one `torch.empty(reduce_bucket_size)` per communication dtype
               (the module's), B x b, from `deepspeed.initialize` on, persistent. overlap_comm only picks the
               stream the reduce runs on (:322; none on CPU): no second bucket, unlike ZeRO-1/2.
  persistent   a parameter of at most `stage3_param_persistence_threshold` elements (`ds_persist`,
               partition_parameters.py:1198) is gathered at its first use and stays whole (n x b) except inside
               `step`: `_partition_all_parameters` frees it, `_post_step` (:2376) gathers it again.
  gathered     the others are all-gathered by the coordinator as their module runs (`fetch_sub_module`):
               `_all_gather_sequential` (partition_parameters.py:1275) gathers one into a buffer of
               ceil(n / W) x W elements that the parameter then views; released after the module unless the
               recorded trace uses it again within `stage3_max_reuse_distance` elements
               (`__params_to_release`, partitioned_param_coordinator.py:574-604): at 1e9 every parameter of a
               model of fewer than 1e9 elements stays gathered from its forward to its backward.
  reduce       `__reduce_and_partition_ipg_grads` (stage3.py:1403) with reduce_scatter on (the default):
               `reduce_scatter_coalesced` (runtime/comm/coalesced_collectives.py:158) concatenates the bucket's
               gradients, each padded to W (`torch.cat` :199), a temporary of the bucket's aligned elements x b,
               and gloo's `reduce_scatter_tensor` a copy of it (CPU only).
  step         `_prepare_fp32_grad_for_sub_group` (:2208): `flatten(averaged_gradients)` (Sigma x b) `.to(float32)`
               (Sigma x 4 more under bf16), then the fp32 gradient alone beside the client's temporaries.
"""

from __future__ import annotations

from llmem.components import zero_ds as z
from llmem.plan import Device, TrainingPlan
from llmem.spec import ModelSpec


def aligned(numel: int, plan: TrainingPlan) -> int:
    """`_aligned_size` (partition_parameters.py:1580): numel padded to a multiple of W."""
    return numel + (-numel % plan.dp)


def partition_sum(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Sigma: the rank's partition elements, ceil(n / W) per trainable tensor (`ds_tensor.ds_numel`). Kept on the
    spec per data-parallel degree (asked at every moment of the walk)."""
    return spec.memo(("deepspeed3 partition sum", plan.dp),
                     lambda: sum(aligned(n, plan) // plan.dp for n in z.ordered_numels(spec)))


def persists(numel: int, plan: TrainingPlan) -> bool:
    """`ds_persist` (partition_parameters.py:1198): at most stage3_param_persistence_threshold elements
    (model_persistence_threshold at its default, sys.maxsize)."""
    return numel <= plan.ds_persistence_threshold


def lp_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The defragmented module-dtype partitions (`lp_param_buffer`, stage3.py:807): Sigma x b."""
    return partition_sum(spec, plan) * z.module_bytes(plan)


def master_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """`fp32_partitioned_groups_flat` (:994/:1006): Sigma x 4."""
    return partition_sum(spec, plan) * 4


def state_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The client optimizer's states over the fp32 partition: AdamW exp_avg + exp_avg_sq (+ its step tensor where
    torch keeps it on the device), SGD its momentum, Adafactor its 1-D variance (`zero_ds.flat_state_bytes`)."""
    return z.flat_state_bytes(partition_sum(spec, plan), plan)


def grad_partition_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """`grad_partitions_flat_buffer` (:633): Sigma elements of the gradient accumulation dtype (the module's)."""
    return partition_sum(spec, plan) * z.module_bytes(plan)


def bucket_bytes(plan: TrainingPlan) -> int:
    """The one contiguous gradient bucket (:624): reduce_bucket_size elements of b, persistent."""
    return plan.ds_reduce_bucket * z.module_bytes(plan)


def gathers_copy(plan: TrainingPlan) -> bool:
    """Whether a gather allocates: on W > 1 `_all_gather_sequential` fills a buffer of its own; on one rank
    `all_gather_coalesced` takes `_no_gather_coalesced` (partition_parameters.py:1449) and `NoGatherHandle`
    (:68) sets `param.data = ds_tensor.data.to(device).view(ds_shape)`, the same device: a view of the whole
    partition (`_aligned_size` pads nothing at W = 1), no bytes; released, `free_param` (:315) drops the view."""
    return plan.dp > 1


def persistent_param_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The whole persistent parameters (n x b each), gathered outside `step` (their elements kept on the spec per
    persistence threshold); none on one rank, where a gather is a view of the partition (`gathers_copy`)."""
    if not gathers_copy(plan):
        return 0
    numel = spec.memo(("deepspeed3 persistent numel", plan.ds_persistence_threshold),
                      lambda: sum(n for n in z.ordered_numels(spec) if persists(n, plan)))
    return numel * z.module_bytes(plan)


def gathered_bytes(spec: ModelSpec, plan: TrainingPlan, indices) -> int:
    """The gathered buffers of the non-persistent tensors `indices` (of `ordered_numels`): ceil(n / W) x W x b;
    none on one rank (views of the partitions, `gathers_copy`)."""
    if not gathers_copy(plan):
        return 0
    numels = z.ordered_numels(spec)
    return sum(aligned(numels[i], plan) for i in indices if not persists(numels[i], plan)) * z.module_bytes(plan)


_USE = (("input_layernorm", 0), ("ln_1", 0), ("post_attention_layernorm", 2), ("pre_feedforward_layernorm", 2),
        ("ln_2", 2), ("attn", 1), ("mlp", 3))  # a decoder layer's tensors in the order its forward uses them


def _use_rank(name: str) -> int:
    return next((rank for key, rank in _USE if key in name), 4)


def backward_order(spec: ModelSpec) -> list[int]:
    """The tensors (indices of `ordered_numels`) in the order backward makes their gradients and runs their hooks:
    the final norm and an untied lm_head (the lm_head first), each decoder layer from the last, its tensors in the
    reverse of the order its forward uses them (llama registers its norms last but uses them first), then the
    input embeddings. Kept on the spec."""
    return spec.memo(("deepspeed backward order",), lambda: _backward_order(spec))


def _backward_order(spec: ModelSpec) -> list[int]:
    outer = spec.outer_params
    first = [i for i, p in enumerate(outer) if z.EMBEDDING.search(p.name)]
    start, layers = len(first), []
    for k in range(spec.num_layers):
        params = spec.layer_params(k)
        layers.append([start + j for j in sorted(range(len(params)), key=lambda j: _use_rank(params[j].name))])
        start += len(params)
    last = range(start, start + len(outer) - len(first))
    return [*reversed(last), *(i for idx in reversed(layers) for i in reversed(idx)), *reversed(first)]


def buckets(spec: ModelSpec, plan: TrainingPlan) -> list[tuple[int, ...]]:
    """The tensors (indices of `ordered_numels`) of each reduce, in backward's order (:1367: the bucket is reduced
    when the next gradient would overflow it)."""
    return z.fill_buckets(z.ordered_numels(spec), backward_order(spec), plan.ds_reduce_bucket)


def uncopied_bytes(spec: ModelSpec, plan: TrainingPlan, tensors: tuple[int, ...]) -> int:
    """A bucket of one tensor larger than reduce_bucket_size: its gradient is not copied into the bucket
    (`__add_grad_to_ipg_bucket` :1390 copies only what fits) and stays a tensor of its own until its reduce."""
    numels = z.ordered_numels(spec)
    return numels[tensors[0]] * z.module_bytes(plan) if len(tensors) == 1 and numels[tensors[0]] > (
        plan.ds_reduce_bucket) else 0


def reduce_temporary_bytes(spec: ModelSpec, plan: TrainingPlan, tensors: tuple[int, ...]) -> int:
    """`reduce_scatter_coalesced`' concatenation (coalesced_collectives.py:199) of one bucket: its tensors each
    padded to W, b bytes (a single tensor divisible by W is reduced in place, :179); then
    `reduce_scatter_tensor` (:205): NCCL reduces in place, gloo (CPU) through a copy of its input it allocates on
    the calling thread (measured: one input's bytes more, 2 ranks)."""
    numels = z.ordered_numels(spec)
    flat = sum(aligned(numels[i], plan) for i in tensors) * z.module_bytes(plan)
    cat = 0 if len(tensors) == 1 and numels[tensors[0]] % plan.dp == 0 else flat
    return cat + (flat if plan.device is Device.CPU else 0)


def step_grad_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """`_prepare_fp32_grad_for_sub_group` (:2211): the flattened partition gradient (Sigma x b) and, under bf16, its
    fp32 copy beside it."""
    s, b = partition_sum(spec, plan), z.module_bytes(plan)
    return s * b + (s * 4 if b != 4 else 0)


def step_temporary_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The client optimizer's temporaries on the one fp32 partition (`zero_ds.flat_step_temporary_bytes`)."""
    return z.flat_step_temporary_bytes(partition_sum(spec, plan), plan)
