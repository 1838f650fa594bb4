"""Optimizer states and the temporaries of `optimizer.step()` (torch/optim/adamw.py, torch/optim/sgd.py, torch 2.13).

States, per parameter the rank optimizes, in the parameter's dtype:
  AdamW: exp_avg + exp_avg_sq = 2 * numel * param_bytes, plus a 0-dim fp32 `step` tensor per parameter tensor
         (on the device only for the fused implementation; on CPU otherwise, which the CPU profile counts).
  SGD (momentum 0.9): momentum_buffer = numel * param_bytes.
Step temporaries (beyond states, gradients and parameters):
  AdamW for-loop: `denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)` holds two copies of the largest tensor at once.
  AdamW foreach: `torch._foreach_sqrt(exp_avg_sqs)` allocates one copy of every parameter the rank optimizes.
  AdamW fused, SGD (all implementations): update in place, no temporaries.
Which tensors, in which dtype and order: the trainable inventory (`llmem.components.trained`), whatever the method.
LoRA: the optimizer gets only the trainable adapters (fp32 under every precision, `llmem.components.lora`) and the
module copies of `--lora-modules-to-save` (the plan's parameter dtype): states in each tensor's own dtype. With two
dtypes (pure half: fp32 adapters, half copies) the foreach step handles one dtype group after the other
(`_group_tensors_by_device_and_dtype`), the second group's temporaries allocated while the first's are still bound:
their sum; per-tensor temporaries (bitsandbytes CPU) take the largest tensor's in its dtype; the AdamW for-loop's
`denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)` makes a tensor's sqrt and quotient while the previous tensor's
`denom` is still bound (the lm_head copy comes last, after an adapter); Adafactor's for-loop walk goes through the
tensors in order, each temporary in its tensor's dtype; its foreach step takes the larger dtype group's peak.

Adafactor (torch/optim/_adafactor.py, torch 2.13; `foreach=None` runs the for-loop on every device):
  States, in the gradient's dtype: a tensor of >= 2 dims gets `row_var` (shape[-1] -> 1) and `col_var`
  (shape[-2] -> 1); a 1-D tensor a full `variance`; no first moment; a 0-dim fp32 `step` on the host (CPU).
  For-loop step: per tensor, `row_mean` / `col_mean` (norms along the last / second-last dim), then
  `var_estimate = row_var @ col_var` (full size) while the previous tensor's `update` (its `var_estimate`) is still
  bound; a 1-D tensor's `grad_squared = grad * grad` and `var_estimate = variance.clone()`. Python locals live until
  rebound, so the step walks the tensors in order (`adafactor_forloop_peak`).
  Foreach step: tensors grouped into matrices and vectors (first-seen order); each group's full-size
  `var_estimates` (vectors: `grads_squared`, then the clones) are allocated while the previous group's `updates` are
  still bound: the sum of both groups.
bitsandbytes AdamW8bit / PagedAdamW8bit (bitsandbytes/optim/optimizer.py: Optimizer2State.init_state, 0.50.2):
  tensors with >= 4096 elements: `state1`, `state2` uint8 (numel each), `absmax1`, `absmax2` fp32 per block of 256;
  the two shared 256-entry fp32 quantization maps (`dynamic`, `udynamic`) once. Smaller tensors: `state1`, `state2`
  fp32 (whatever the parameter dtype). `step` is a Python int.
  Paged: on CUDA the uint8/fp32 states of tensors with >= 1e5 elements are allocated by `F.get_paged` in CUDA unified
  memory, outside PyTorch's allocator (not in `max_memory_allocated`; reported apart, `paged_state_bytes`); on CPU
  bitsandbytes falls back to ordinary tensors.
  Step: on CUDA one fused kernel per tensor updates the states in place (no temporaries). On CPU
  (bitsandbytes/backends/cpu/ops.py) the 8-bit update dequantizes both states to fp32, `grad = g.float() * 1.0`,
  `p.data.float()` (a copy unless fp32), `denom = (state2.sqrt() / c2).add_(eps)`: at its division
  state1, state2, grad, [p copy], sqrt and the quotient are live (20 bytes per element, 24 if not fp32);
  the 32-bit update holds `g.float() * 1.0`, [p copy] and `state1 / (state2.sqrt() + eps)`'s two operands.
"""

from __future__ import annotations

import math
import operator

from llmem.components.trained import Trained, trained_tensors
from llmem.plan import Device, Engine, Offload, Optimizer, OptimizerImpl, Scheme, TrainingPlan
from llmem.spec import ModelSpec, ParamTensor, per_spec

STEP_TENSOR_BYTES = 4  # torch.tensor(0.0, dtype=torch.float32)
OFFLOAD_MINIMAL_SIZE = 4096  # torchao CPUOffloadOptimizer(minimal_size=4096): smaller tensors step on the GPU


@per_spec("layout_key")
def optimized(spec: ModelSpec, plan: TrainingPlan) -> Trained:
    """The tensors this rank's optimizer updates, in the order it walks them: the trained ones
    (`trained.trained_tensors`, whatever the method), of which torchao's `CPUOffloadOptimizer` keeps the small ones
    on the GPU (`--offload optimizer`), and ZeRO-1 this rank's partition (largest first; the rank with the most
    bytes is taken)."""
    items = trained_tensors(spec, plan)
    if plan.offload is Offload.OPTIMIZER:
        items = items.select([k for k, n in enumerate(items.numel) if n < OFFLOAD_MINIMAL_SIZE])
    if plan.scheme is not Scheme.ZERO1:
        return items
    index = spec.memo(("zero1_partition", plan.dp, items.numel, items.elem_bytes),  # compare asks many times
                      lambda: _largest_partition(items, plan.dp))
    return items.select(index)


def _largest_partition(items: Trained, world: int) -> list[int]:
    parts = greedy_partition(range(len(items.numel)), world, size=items.numel.__getitem__)
    return max(parts, key=lambda part: sum(items.numel[k] * items.elem_bytes[k] for k in part))


def _fsdp1(plan: TrainingPlan) -> bool:
    return plan.engine is Engine.FSDP1


def optimized_params(spec: ModelSpec, plan: TrainingPlan) -> list[int]:
    """Local element counts of the tensors this rank's optimizer updates (ZeRO-1: this rank's partition; FSDP1:
    the original parameters' views of the flat shards)."""
    if _fsdp1(plan):
        from llmem.components.flat_param import optimized_sizes

        return list(optimized_sizes(spec, plan))
    return list(optimized(spec, plan).numel)


def _group_bytes(spec: ModelSpec, plan: TrainingPlan) -> list[list[int]]:
    """Bytes of the optimized tensors per parameter group (`param_groups`)."""
    if _fsdp1(plan):  # one dtype: the trained tensors' (FSDP1 trains no module copies)
        pb = max(trained_tensors(spec, plan).elem_bytes, default=plan.precision.param_bytes)
        return [[n * pb for n in optimized_params(spec, plan)]]
    items = optimized(spec, plan)
    nbytes = list(map(operator.mul, items.numel, items.elem_bytes))
    if plan.scheme is not Scheme.TP:
        return [nbytes]
    return _split(nbytes, items.dtensor)


def _split(values: list, dtensor: tuple[bool, ...]) -> list[list]:
    """TP: the DTensors' group, then the plain tensors' (a group only if it has a tensor)."""
    groups = [[v for v, d in zip(values, dtensor, strict=True) if d],
              [v for v, d in zip(values, dtensor, strict=True) if not d]]
    return [g for g in groups if g]


def zero1_partitions(params: tuple[ParamTensor, ...], world: int) -> list[list[int]]:
    """`ZeroRedundancyOptimizer._partition_parameters`: tensors sorted by size, largest first, each to the rank
    with the least assigned so far (ties to the lowest rank)."""
    return greedy_partition([p.numel for p in params], world)


def greedy_partition(items: list, world: int, size=lambda n: n) -> list[list]:
    """`ZeroRedundancyOptimizer._partition_parameters` (torch/distributed/optim/zero_redundancy_optimizer.py):
    items sorted by size, largest first (stable), each to the rank with the least assigned so far (ties to the
    lowest rank). `size` reads an item's size (the items are sizes themselves by default)."""
    parts: list[list] = [[] for _ in range(world)]
    totals = [0] * world
    for item in sorted(items, key=size, reverse=True):
        r = totals.index(min(totals))
        parts[r].append(item)
        totals[r] += size(item)
    return parts


def param_groups(spec: ModelSpec, plan: TrainingPlan) -> list[list[int]]:
    """Local sizes per optimizer parameter group (`llmem.runtime.optim.param_groups`): under TP the sharded
    DTensor parameters (`Trained.dtensor`) and the replicated plain ones form two groups, and a foreach step's
    temporaries are allocated and freed group by group. Other schemes: one group."""
    if plan.scheme is not Scheme.TP or _fsdp1(plan):
        return [optimized_params(spec, plan)]
    items = optimized(spec, plan)
    return _split(list(items.numel), items.dtensor)


BNB_MIN_8BIT_SIZE = 4096  # Optimizer2State(min_8bit_size=4096)
BNB_BLOCKSIZE = 256  # Optimizer2State.init_state: blocksize = 256
BNB_QMAP_BYTES = 2 * 256 * 4  # name2qmap["dynamic"], ["udynamic"]: create_dynamic_map() -> 256 fp32 values each
BNB_PAGED_MIN_SIZE = 100_000  # Optimizer8bit.get_state_buffer: paged only when p.numel() >= 1e5
BNB_OPTIMIZERS = (Optimizer.ADAMW8BIT, Optimizer.PAGED_ADAMW8BIT)


def optimized_shapes(spec: ModelSpec, plan: TrainingPlan) -> list[tuple[int, ...]]:
    """Shapes of the tensors this rank's optimizer updates, in the order it walks them (single GPU and DDP:
    `model.parameters()` order; ZeRO-1: this rank's partition, largest first, as ZeroRedundancyOptimizer sorts)."""
    return list(optimized(spec, plan).shape)


def adafactor_state_elements(shape: tuple[int, ...]) -> int:
    """row_var + col_var for >= 2 dims, variance for 1-D (`Adafactor._init_group`)."""
    n = math.prod(shape)
    if len(shape) > 1:
        return n // shape[-1] + n // shape[-2]
    return n


def adafactor_forloop_peak(shapes: list[tuple[int, ...]], scale: list[int] | None = None) -> int:
    """Largest number of temporary elements alive in `_single_tensor_adafactor` (see the module docstring);
    with `scale` (bytes per element of each tensor) the largest number of bytes."""
    live: dict[str, int] = {}
    peak = 0

    def bind(name: str, n: int) -> None:  # the new value exists before the old one bound to `name` is released
        nonlocal peak
        peak = max(peak, sum(live.values()) + n)
        live[name] = n

    for k, shape in enumerate(shapes):
        n = math.prod(shape)
        if scale is not None:  # every temporary of this tensor has its dtype: count bytes
            n *= scale[k]
        if len(shape) > 1:
            bind("row_mean", n // shape[-1])
            bind("col_mean", n // shape[-2])
            bind("var_estimate", n)  # row_var @ col_var
            peak = max(peak, sum(live.values()) + n // (shape[-1] * shape[-2]))  # row_var.mean(dim=-2)
        else:
            bind("grad_squared", n)
            bind("var_estimate", n)  # variance.clone()
        live["update"] = live.pop("var_estimate")  # update = var_estimate.clamp_(...): the previous update freed
    return peak


def adafactor_foreach_peak(shapes: list[tuple[int, ...]]) -> int:
    """`_multi_tensor_adafactor`: the matrix and the vector group's full-size temporaries, the second group's
    allocated while the first group's `updates` are bound."""
    matrices = sum(math.prod(s) for s in shapes if len(s) > 1)
    vectors = sum(math.prod(s) for s in shapes if len(s) == 1)
    return matrices + vectors


def _bnb_state_bytes(shapes: list[tuple[int, ...]], device_only: bool = False, host_maps: bool = False) -> int:
    """AdamW8bit states; `device_only`: leave out the paged (unified-memory) ones of PagedAdamW8bit on CUDA.
    The two quantization maps: `Optimizer8bit.__init__` makes them on the CPU for every 8-bit optimizer
    (bitsandbytes 0.50.2 optim/optimizer.py:154-155, `fill_qmap`), and `init_state` moves them to the device only
    for a tensor with 8-bit states (:513-516); `host_maps`: the device is the CPU, where they always count."""
    total = 0
    any_8bit = False
    for shape in shapes:
        n = math.prod(shape)
        paged = device_only and n >= BNB_PAGED_MIN_SIZE
        if n >= BNB_MIN_8BIT_SIZE:
            any_8bit = True
            total += 2 * 4 * math.ceil(n / BNB_BLOCKSIZE) + (0 if paged else 2 * n)
        elif not paged:
            total += 2 * 4 * n
    return total + (BNB_QMAP_BYTES if any_8bit or host_maps else 0)


@per_spec("layout_key")
def paged_state_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """PagedAdamW8bit on CUDA: the states in CUDA unified memory, outside `max_memory_allocated`."""
    if plan.optimizer is not Optimizer.PAGED_ADAMW8BIT or plan.device is not Device.CUDA:
        return 0
    shapes = optimized_shapes(spec, plan)
    return _bnb_state_bytes(shapes) - _bnb_state_bytes(shapes, device_only=True)


def _step_tensors_on_device(plan: TrainingPlan) -> bool:
    return plan.device is Device.CPU or plan.effective_optimizer_impl is OptimizerImpl.FUSED


@per_spec("layout_key")
def optimizer_state_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """State tensors in the caching allocator (PagedAdamW8bit on CUDA: without its unified-memory states), each in
    its tensor's dtype (`Trained.elem_bytes`)."""
    if plan.optimizer in BNB_OPTIMIZERS:
        paged = plan.optimizer is Optimizer.PAGED_ADAMW8BIT and plan.device is Device.CUDA
        return _bnb_state_bytes(optimized_shapes(spec, plan), device_only=paged, host_maps=plan.device is Device.CPU)
    if plan.optimizer is Optimizer.ADAFACTOR:
        items = optimized(spec, plan)
        steps = len(items.numel) * STEP_TENSOR_BYTES if plan.device is Device.CPU else 0
        return sum(adafactor_state_elements(sh) * pb for sh, pb in zip(items.shape, items.elem_bytes, strict=True)) \
            + steps
    groups = _group_bytes(spec, plan)
    nbytes, count = sum(map(sum, groups)), sum(map(len, groups))
    if plan.optimizer is Optimizer.SGD:
        return nbytes
    return 2 * nbytes + (count * STEP_TENSOR_BYTES if _step_tensors_on_device(plan) else 0)


@per_spec("layout_key")
def optimizer_step_temporary_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """`optimizer.step()`'s temporaries beyond states, gradients and parameters (see the module docstring), each in
    its tensor's dtype."""
    impl = plan.effective_optimizer_impl
    if plan.optimizer is Optimizer.ADAFACTOR:
        items = optimized(spec, plan)
        pairs = list(zip(items.shape, items.elem_bytes, strict=True))
        if impl is OptimizerImpl.FOREACH:  # one dtype group after the other: the larger group's peak
            return max((adafactor_foreach_peak([sh for sh, b in pairs if b == pb]) * pb
                        for pb in set(items.elem_bytes)), default=0)
        return adafactor_forloop_peak(list(items.shape), list(items.elem_bytes))
    if plan.optimizer in BNB_OPTIMIZERS:
        # bitsandbytes' 8-bit step is one operator per tensor (`optimizer_update_8bit_blockwise`): its CUDA kernel
        # updates the states in place; the CPU kernel's fp32 working copies are freed before it returns (kernel
        # scratch, left out of the CPU measurement: llmem/measure/kernels.py)
        return 0
    if plan.optimizer is not Optimizer.ADAMW:
        return 0
    if impl is OptimizerImpl.FORLOOP:
        # torch/optim/adam.py `_single_tensor_adam`: `denom = (exp_avg_sq.sqrt() / c).add_(eps)` makes the sqrt and
        # the quotient while the previous tensor's `denom` is still bound, within one parameter group
        return max((2 * g[i] + (g[i - 1] if i else 0) for g in _group_bytes(spec, plan) for i in range(len(g))),
                   default=0)
    if impl is OptimizerImpl.FOREACH:  # every dtype group's temporaries of a parameter group at once
        return max(sum(group) for group in _group_bytes(spec, plan))
    return 0
