"""DeepSpeed ZeRO-1/2 (`--engine deepspeed`, deepspeed 0.19.0 `runtime/zero/stage_1_and_2.py`,
`DeepSpeedZeroOptimizer`): the sizes of one rank's tensors, each a small function with its source line.

The module's parameters are views into one flat tensor per parameter group; llmem's client optimizer has one group.
b = bytes per element of the module: 2 under bf16 (the engine casts the module, `engine.py`
`_configure_distributed_model`), 4 in fp32. W = data-parallel ranks. P = trainable elements in registration order.
  flat         `flatten_dense_tensors_aligned` (:421): P padded at its end to a multiple of
               `nccl_start_alignment_factor` (2, :328) x W (:373): P_pad elements of b bytes, persistent.
  partition    `get_data_parallel_partitions` (:1820): rank r owns [r.S, (r+1).S), S = P_pad / W.
  master       `single_partition_of_fp32_groups` (:473): `.clone().to(float32)` of the rank's partition, S x 4,
               even in fp32 (a clone).
  states       the client optimizer steps the fp32 partition: AdamW 2 x S x 4 (+ its step tensor), SGD S x 4.
  bucket       `setup_buckets` (:2326) at the first gradient hook: `torch.empty(reduce_bucket_size)`, B x b, whatever
               the model's size; each gradient is copied into it (:1118) and its own storage freed; released at
               the epilogue (`_release_ipg_buffers`, :789).
  flatten      `allreduce_bucket` (:1695): a group of the bucket's per-partition slices flattened into a new tensor
               for the all-reduce (`use_multi_rank_bucket_allreduce`), freed after the copy back; one slice is a
               view (`flatten_numel`).
  partition grads `copy_grads_in_partition` (:1534): at the first reduce that holds a parameter of the rank's
               partition, one tensor of the summed numel of every parameter that touches the partition, b bytes.
  step         `step` (:2184): `flatten(averaged_gradients)` (S x b) then `.to(float32)` (S x 4 more under bf16),
               while the partition gradients live; then the fp32 gradient alone beside the optimizer's temporaries;
               then `all_gather_into_tensor` of the new partitions into the flat (`runtime/utils.py:1013`): gloo
               gathers through an output it allocates (P_pad x b, CPU only; NCCL writes in place).
"""

from __future__ import annotations

import re
from itertools import accumulate

from llmem.components.optimizer import STEP_TENSOR_BYTES, adafactor_foreach_peak, adafactor_forloop_peak
from llmem.plan import Device, Optimizer, OptimizerImpl, Precision, TrainingPlan
from llmem.spec import ModelSpec

ALIGNMENT = 2  # `nccl_start_alignment_factor`: 4-byte alignment / sizeof(fp16) (stage_1_and_2.py:328)
EMBEDDING = re.compile(r"embed|wte|wpe|word_embeddings")


def module_bytes(plan: TrainingPlan) -> int:
    """b: bf16 when the ds_config enables it (`--precision bf16-mixed`), else the fp32 module."""
    return 2 if plan.precision is Precision.BF16_MIXED else 4


def buffer_bytes(spec, plan: TrainingPlan) -> int:
    """The model's buffers (`components.parameters.buffer_bytes`), whole on every rank (ZeRO partitions
    parameters only), cast with the module by `self.module.bfloat16()` when the ds_config enables bf16
    (deepspeed 0.19.0 `runtime/engine.py:1460-1463`). `spec`: the model or the adapters' view of it."""
    from llmem.components.parameters import buffer_bytes as model_buffer_bytes

    model = getattr(spec, "base", spec)  # `ds_lora.TrainableView` keeps the model as `base`
    return model_buffer_bytes(model, plan, 2 if plan.precision is Precision.BF16_MIXED else None)


def ordered_numels(spec: ModelSpec) -> tuple[int, ...]:
    """The trainable tensors in `model.parameters()` order: the input embeddings, the decoder layers, then the rest
    (final norm, an untied lm_head): the order `bit16_groups` keeps (`round_robin_gradients` off). Kept on the spec
    (asked per bucket)."""
    def compute() -> tuple[int, ...]:
        outer = spec.outer_params
        first = [p.numel for p in outer if EMBEDDING.search(p.name)]
        last = [p.numel for p in outer if not EMBEDDING.search(p.name)]
        layers = [p.numel for layer in range(spec.num_layers) for p in spec.layer_params(layer)]
        return tuple(first + layers + last)

    return spec.memo(("deepspeed ordered numels",), compute)


def backward_keys(spec: ModelSpec) -> tuple[int, ...]:
    """Per tensor of `ordered_numels`, when backward makes its gradient, as a layer index: the final norm and an
    untied lm_head first (num_layers), then the decoder layers from the last down, the input embeddings last (-1)."""
    outer = spec.outer_params
    first = [-1 for p in outer if EMBEDDING.search(p.name)]
    last = [spec.num_layers for p in outer if not EMBEDDING.search(p.name)]
    return tuple(first + [k for k in range(spec.num_layers) for _ in spec.layer_params(k)] + last)


def untied_head_numel(spec: ModelSpec) -> int:
    """The lm_head's elements when it is a tensor of its own (its hook is the backward's first), else 0."""
    return max((p.numel for p in spec.outer_params if not EMBEDDING.search(p.name) and p.numel >= spec.vocab_size),
               default=0)


def flat_numel(spec: ModelSpec, plan: TrainingPlan) -> int:
    """P_pad: P rounded up to a multiple of 2 W (`flatten_dense_tensors_aligned`, :421 with :373)."""
    total, align = sum(ordered_numels(spec)), ALIGNMENT * plan.dp
    return total + (-total % align)


def partition_numel(spec: ModelSpec, plan: TrainingPlan) -> int:
    """S = P_pad / W (`get_data_parallel_partitions`, :1828: P_pad divides evenly)."""
    return flat_numel(spec, plan) // plan.dp


def flat_param_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """`bit16_groups_flat`: the module's parameters, P_pad x b."""
    return flat_numel(spec, plan) * module_bytes(plan)


def master_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """`single_partition_of_fp32_groups` (:473): S x 4."""
    return partition_numel(spec, plan) * 4


def state_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The client optimizer's states over the one fp32 partition tensor: AdamW exp_avg + exp_avg_sq (and the step
    tensor where torch keeps it as a tensor on the device), SGD its momentum buffer (`flat_state_bytes`)."""
    return flat_state_bytes(partition_numel(spec, plan), plan)


def flat_state_bytes(n: int, plan: TrainingPlan) -> int:
    """The client optimizer's states over one fp32 tensor of n elements: AdamW's two (+ its step tensor on the
    device), SGD's momentum, Adafactor's variance of a 1-D tensor (`Adafactor._init_group`: no row / column
    factors below 2 dims; its step a tensor on CPU, as `optimizer.optimizer_state_bytes` counts it)."""
    s = n * 4
    if plan.optimizer is Optimizer.ADAFACTOR:
        return s + (STEP_TENSOR_BYTES if plan.device is Device.CPU else 0)
    if plan.optimizer is Optimizer.SGD:
        return s
    on_device = plan.device is Device.CPU or plan.effective_optimizer_impl is OptimizerImpl.FUSED
    return 2 * s + (STEP_TENSOR_BYTES if on_device else 0)


def step_temporary_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The client optimizer's temporaries on the one fp32 partition (`flat_step_temporary_bytes`)."""
    return flat_step_temporary_bytes(partition_numel(spec, plan), plan)


def flat_step_temporary_bytes(n: int, plan: TrainingPlan) -> int:
    """The client optimizer's step temporaries on one fp32 tensor of n elements: AdamW for-loop `denom =
    (exp_avg_sq.sqrt() / c)` two tensors of n (torch/optim/adam.py `_single_tensor_adam`), foreach one, fused none;
    Adafactor the 1-D path of `_single_tensor_adafactor` (grad², the variance's clone: `adafactor_forloop_peak`);
    SGD none."""
    impl = plan.effective_optimizer_impl
    if plan.optimizer is Optimizer.ADAFACTOR:
        peak = adafactor_foreach_peak if impl is OptimizerImpl.FOREACH else adafactor_forloop_peak
        return peak([(n,)]) * 4
    if plan.optimizer is not Optimizer.ADAMW:
        return 0
    count = {OptimizerImpl.FORLOOP: 2, OptimizerImpl.FOREACH: 1}.get(impl, 0)
    return count * n * 4


def bucket_bytes(plan: TrainingPlan) -> int:
    """The contiguous gradient bucket (`setup_buckets`, :2326): reduce_bucket_size elements of b, from the first
    gradient hook to the epilogue; under overlap_comm a second one beside it (:2333, `buf_1`), the two swapped at
    each reduce (:1097)."""
    return plan.ds_reduce_bucket * module_bytes(plan) * (2 if plan.ds_overlap_comm else 1)


def reduces_in_backward(plan: TrainingPlan) -> bool:
    """Whether the gradient hooks move each gradient into the bucket and reduce it in backward: ZeRO-2, and ZeRO-1
    under overlap_comm (`process_gradients`, :1618: `partition_gradients or overlap_comm`; `reduce_gradients` then
    skips its own pass, :835). ZeRO-1 without it keeps the whole gradients until `reduce_gradients` after backward."""
    return plan.zero == 2 or plan.ds_overlap_comm


def partition_grad_numel(spec: ModelSpec, plan: TrainingPlan, rank: int) -> int:
    """`copy_grads_in_partition` (:1529): the summed numel of every tensor that touches rank `rank`'s partition
    (`get_partition_info`, :1840: a tensor across a boundary counts whole). Every rank's in one pass over the
    tensors, kept on the spec per data-parallel degree (asked per rank and per hook)."""
    return spec.memo(("deepspeed partition grads", plan.dp), lambda: _partition_grad_numels(spec, plan))[rank]


def _partition_grad_numels(spec: ModelSpec, plan: TrainingPlan) -> tuple[int, ...]:
    s, totals, start = partition_numel(spec, plan), [0] * plan.dp, 0
    for n in ordered_numels(spec):
        for r in range(start // s, (start + n - 1) // s + 1) if n else ():  # the partitions [start, start + n) meets
            totals[r] += n
        start += n
    return tuple(totals)


def buckets(spec: ModelSpec, plan: TrainingPlan, reverse: bool) -> list[tuple[int, ...]]:
    """The tensors (indices in registration order) of each bucket as `reduce_independent_p_g_buckets_and_remove_grads`
    fills it (:1091: reduce first when the next tensor would overflow B), in registration order (ZeRO-1's
    `reduce_gradients`, :827) or in reverse (ZeRO-2's hooks in backward, roughly the backward's order)."""
    numels = ordered_numels(spec)
    order = range(len(numels) - 1, -1, -1) if reverse else range(len(numels))
    return fill_buckets(numels, order, plan.ds_reduce_bucket)


def fill_buckets(numels: list[int], order, bucket: int) -> list[tuple[int, ...]]:
    """The tensors (indices of `numels`) of each reduce as their gradients come in `order`: a bucket is reduced
    when the next gradient would overflow `bucket` elements (a tensor larger than it is a bucket of its own)."""
    out: list[list[int]] = [[]]
    filled = 0
    for i in order:
        if filled + numels[i] > bucket and out[-1]:
            out.append([])
            filled = 0
        out[-1].append(i)
        filled += numels[i]
    return [tuple(b) for b in out if b]


def extra_large(spec: ModelSpec, plan: TrainingPlan, tensors: tuple[int, ...]) -> bool:
    """A bucket of one tensor larger than reduce_bucket_size: reduced in its own gradient, not copied (:1116)."""
    return len(tensors) == 1 and ordered_numels(spec)[tensors[0]] > plan.ds_reduce_bucket


def flatten_numel(spec: ModelSpec, plan: TrainingPlan, tensors: tuple[int, ...]) -> int:
    """The largest flatten of one bucket's reduce: `average_tensor` (:1226) cuts the bucket, tensor by tensor in its
    order, into one slice per destination partition (consecutive slices of one partition merged, :1287);
    `allreduce_and_scatter` (:1190) gathers slices until their numel exceeds reduce_bucket_size and
    `allreduce_bucket` (:1695) flattens each group, `_flatten_dense_tensors`, a new tensor for two slices or more
    and a view of a single one (no memory): a bucket inside one partition, or an extra-large tensor's slices each
    above the bucket size, flattens nothing."""
    offsets = spec.memo(("deepspeed offsets",), lambda: tuple(accumulate(ordered_numels(spec), initial=0)))
    s = partition_numel(spec, plan)
    slices: list[list[int]] = []  # [partition, numel]
    for i in tensors:
        start, end = offsets[i], offsets[i + 1]
        while start < end:
            cut = min(end, (start // s + 1) * s)
            if slices and slices[-1][0] == start // s:
                slices[-1][1] += cut - start
            else:
                slices.append([start // s, cut - start])
            start = cut
    largest, group, count = 0, 0, 0
    for _, n in slices:
        group, count = group + n, count + 1
        if group > plan.ds_reduce_bucket:
            largest, group, count = max(largest, group if count > 1 else 0), 0, 0
    return max(largest, group if count > 1 else 0)


def owner_ranks(spec: ModelSpec, plan: TrainingPlan) -> list[range]:
    """The ranks whose partition each tensor touches (`param_to_partition_ids`), as a range."""
    s, start, out = partition_numel(spec, plan), 0, []
    for n in ordered_numels(spec):
        out.append(range(start // s, (start + max(n, 1) - 1) // s + 1))
        start += n
    return out


def candidate_ranks(spec: ModelSpec, plan: TrainingPlan) -> tuple[int, ...]:
    """The ranks whose moments are evaluated: the first and the last (their partitions are reduced first in one
    order or the other) and the one with the most partition gradients."""
    most = max(range(plan.dp), key=lambda r: partition_grad_numel(spec, plan, r)) if plan.dp <= 64 else 0
    return tuple(sorted({0, plan.dp - 1, most}))


def step_grad_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """`step` (:2184): the flattened partition gradient (S x b) and, under bf16, its fp32 copy (S x 4)."""
    s = partition_numel(spec, plan)
    b = module_bytes(plan)
    return s * b + (s * 4 if b != 4 else 0)


def gather_output_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The step's all-gather of the new partitions: gloo (CPU) gathers through an output of P_pad x b it allocates;
    NCCL (CUDA) gathers into the flat in place."""
    return flat_param_bytes(spec, plan) if plan.device is Device.CPU else 0


# --- ZeRO-0 (no ZeRO optimizer: the engine all-reduces the whole gradients itself) -------------------------------
ALLREDUCE_BUCKET = 500_000_000  # `MEMORY_OPT_ALLREDUCE_SIZE` (engine.py:132): `allreduce_gradients`' default, the one
# `_backward_epilogue` (:2482) uses; reduce_bucket_size does not reach stage 0


def allreduce_flatten_numels(spec: ModelSpec) -> tuple[int, ...]:
    """ZeRO-0's `buffered_allreduce_fallback` (engine.py:3140): the gradients in `module.named_parameters()` order
    (:3067), appended to a bucket that is flattened and all-reduced once it holds more than 5e8 elements
    (`allreduce_no_retain`, :3053; the rest at the end), then copied back: each flatten's elements."""
    out, numel = [], 0
    for n in ordered_numels(spec):
        numel += n
        if numel > ALLREDUCE_BUCKET:
            out.append(numel)
            numel = 0
    return tuple(out + [numel] * bool(numel))
