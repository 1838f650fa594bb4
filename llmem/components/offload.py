"""`--offload optimizer+params`: FSDP2 `fully_shard(..., offload_policy=CPUOffloadPolicy())` (pin_memory=True) on
every decoder layer and the root (torch 2.13, torch/distributed/fsdp/_fully_shard).

What moves to host memory, per rank (`host_breakdown`):
  parameters  `FSDPParam._init_sharded_param`: the padded shard is copied `.cpu()` then `.pin_memory()`; the
              sharded parameter (and the optimizer's view of it) lives on the host.
  gradients   `_fsdp_collectives.py: foreach_reduce`: each sharded gradient (a view of `reduce_output`) is copied
              `.to("cpu", non_blocking=True)` (pinned, as torch's `_to_copy` pins a non-blocking device-to-host copy)
              right after the reduce-scatter; the device `reduce_output` is freed at once.
  optimizer   the optimizer is built on the (host) sharded parameters: its states are plain host tensors and
              `optimizer.step()` runs on the CPU (the implementation flag the plan gives, e.g. foreach's
              temporaries are host memory too).
What stays on the GPU (`llmem.walk.fsdp.fsdp_phases`): the all-gather outputs and unsharded parameters during
forward/backward, the unsharded gradients until their reduce-scatter, `reduce_scatter_input`, the reduce-scatter
output until its device-to-host copy is issued, activations and logits — everything but the sharded parameters,
sharded gradients, optimizer states and step temporaries. The host-to-device copy of each shard before the
all-gather (`FSDPParam.all_gather_inputs`: `.to(device)` then the cast to param_dtype) lives only inside
`foreach_all_gather`'s copy-in, a moment below the modelled ones (one layer's shard, A/dp, against a layer's
activations), as the non-offloaded flat copy-in buffer of the same size is.

Pinned host memory comes from the caching host allocator, which rounds each block up to a power of two
(`CachingHostAllocator.h`, default `pinned_max_round_threshold`): `host_pinned_bytes`.
`--offload optimizer` (one GPU): torchao's `CPUOffloadOptimizer(params, torch.optim.AdamW|SGD,
offload_gradients=<grad-accum == 1>, minimal_size=4096, **the plan's flags)` (torchao/optim/cpu_offload.py), the
single-GPU counterpart of DeepSpeed's ZeRO-Offload. For every trainable tensor of at least `minimal_size` elements it
allocates a pinned host copy and a pinned host gradient (`torch.empty_like(p, device="cpu", pin_memory=True)`: the
parameter's dtype) and builds one optimizer on the host copy; smaller tensors (norm weights of narrow models,
biases) stay with an on-device optimizer. A `post_accumulate_grad_hook` copies each finished gradient to the host;
with `offload_gradients=True` it then drops the device gradient (`record_stream` + `p.grad = None`: the caching
allocator counts the block free at once and only delays its reuse), so an offloaded gradient lives on the GPU only
from its AccumulateGrad to its hook. torchao refuses `offload_gradients` under gradient accumulation, so with
`--grad-accum K > 1` the gradients stay on the GPU until zero_grad and only the states move. `step()` runs each host
optimizer on the CPU, then copies the host parameter back into the device parameter in place (no GPU allocation).

Not measurable here: on a CPU mesh `CPUOffloadPolicy()` fails in `fully_shard` (`pin_memory()` needs an
accelerator) and with `pin_memory=False` every copy is a no-op (the device is the host), so the plan rejects
`--device cpu`; torchao's optimizer asserts a CUDA or XPU device.
"""

from __future__ import annotations

from llmem.components import Category, lora
from llmem.components.optimizer import OFFLOAD_MINIMAL_SIZE as MINIMAL_SIZE
from llmem.components.optimizer import optimized_params, optimizer_step_temporary_bytes
from llmem.components.sharding import local_numel, shard_summary
from llmem.plan import Offload, Optimizer, OptimizerImpl, TrainingPlan
from llmem.spec import ModelSpec

GPUS_PER_NODE = 8  # ranks sharing one host's memory (a typical 8-GPU server; fewer when the job is smaller)
STEP_TENSOR_BYTES = 4


def is_offloaded(plan: TrainingPlan) -> bool:
    return plan.offload is Offload.OPTIMIZER_PARAMS


def offloads_optimizer(plan: TrainingPlan) -> bool:
    """`--offload optimizer`: torchao's CPUOffloadOptimizer on one GPU."""
    return plan.offload is Offload.OPTIMIZER


def offloads_gradients(plan: TrainingPlan) -> bool:
    """CPUOffloadOptimizer's `offload_gradients=True`, which torchao allows only without gradient accumulation."""
    return offloads_optimizer(plan) and plan.grad_accum == 1


def stays_on_device(numel: int) -> bool:
    """Whether CPUOffloadOptimizer leaves a trainable tensor of `numel` elements to its on-device optimizer."""
    return numel < MINIMAL_SIZE


def device_gradient_bytes(params, plan: TrainingPlan) -> int:
    """Of the gradients of `params`, the bytes that stay on the GPU once their hooks ran: all of them unless the
    gradients are offloaded, else only those of tensors below `minimal_size`."""
    sizes = [local_numel(p, plan) for p in params]
    if offloads_gradients(plan):
        sizes = [n for n in sizes if stays_on_device(n)]
    return sum(sizes) * plan.precision.param_bytes


def _host_optimizer_sizes(spec: ModelSpec, plan: TrainingPlan) -> list[int]:
    return [n for n in shard_summary(spec, plan).sizes if not stays_on_device(n)]


def optimizer_host_breakdown(spec: ModelSpec, plan: TrainingPlan) -> dict:
    """Host bytes of CPUOffloadOptimizer at its largest moment (its `step()`): per offloaded tensor a pinned copy
    and a pinned gradient in the parameter's dtype, the host optimizer's states (AdamW: exp_avg, exp_avg_sq and a
    0-dim fp32 `step` on the CPU; SGD: the momentum buffer) and one tensor's step temporaries (each host optimizer
    holds one tensor: the for-loop's two temporaries, foreach's one, none fused)."""
    pb = plan.precision.param_bytes
    sizes = _host_optimizer_sizes(spec, plan)
    largest = max(sizes, default=0) * pb
    if plan.optimizer is Optimizer.SGD:
        states, temporaries = sum(sizes) * pb, 0
    else:
        states = 2 * sum(sizes) * pb + len(sizes) * STEP_TENSOR_BYTES
        impl = plan.effective_optimizer_impl
        temporaries = {OptimizerImpl.FORLOOP: 2 * largest, OptimizerImpl.FOREACH: largest}.get(impl, 0)
    return {
        Category.PARAMETERS: sum(sizes) * pb,
        Category.GRADIENTS: sum(sizes) * pb,
        Category.OPTIMIZER: states,
        Category.TEMPORARIES: temporaries,
    }


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else n


def _fsdp_host_tensors(spec: ModelSpec, plan: TrainingPlan) -> tuple[list[int], list[int], int]:
    """`--offload optimizer+params`: the bytes of each sharded parameter on the host (`_fsdp_param.py:312-315`:
    every FSDP parameter, frozen or trainable; LoRA's fp32 adapters beside the base), the element counts of the
    trainable ones (only they get a gradient, `foreach_reduce`'s copy to the host, and optimizer states) and their
    bytes per element."""
    pb = plan.precision.param_bytes
    params = [n * pb for n in shard_summary(spec, plan).sizes]
    trainable_bytes = pb
    if lora.is_lora(plan):
        trainable_bytes = lora.adapter_elem_bytes(spec)
        params += [n * trainable_bytes for n in lora.sharded_adapter_sizes(spec, plan)]
    return params, optimized_params(spec, plan), trainable_bytes


def host_breakdown(spec: ModelSpec, plan: TrainingPlan) -> dict:
    """Host bytes of one rank at its largest moment (the optimizer step), by category; empty when not offloaded."""
    if offloads_optimizer(plan):
        return optimizer_host_breakdown(spec, plan)
    if not is_offloaded(plan):
        return {}
    params, sizes, tb = _fsdp_host_tensors(spec, plan)
    if plan.optimizer is Optimizer.SGD:
        states = sum(sizes) * tb
    else:  # exp_avg, exp_avg_sq and the 0-dim fp32 step, all on the host with the parameters
        states = 2 * sum(sizes) * tb + len(sizes) * STEP_TENSOR_BYTES
    return {
        Category.PARAMETERS: sum(params),
        Category.GRADIENTS: sum(sizes) * tb,
        Category.OPTIMIZER: states,
        Category.TEMPORARIES: optimizer_step_temporary_bytes(spec, plan),
    }


def host_pinned_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Pinned host memory of one rank: each sharded parameter and each trainable one's gradient block rounded up
    to a power of two."""
    if offloads_optimizer(plan):
        return 2 * sum(_pow2(n * plan.precision.param_bytes) for n in _host_optimizer_sizes(spec, plan))
    if not is_offloaded(plan):
        return 0
    params, sizes, tb = _fsdp_host_tensors(spec, plan)
    return sum(map(_pow2, params)) + sum(_pow2(n * tb) for n in sizes)


def ranks_per_node(plan: TrainingPlan) -> int:
    return min(plan.gpus, GPUS_PER_NODE)
