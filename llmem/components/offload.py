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
What stays on the GPU (`llmem.estimate.fsdp_phases`): the all-gather outputs and unsharded parameters during
forward/backward, the unsharded gradients until their reduce-scatter, `reduce_scatter_input`, the reduce-scatter
output until its device-to-host copy is issued, activations and logits — everything but the sharded parameters,
sharded gradients, optimizer states and step temporaries. The host-to-device copy of each shard before the
all-gather (`FSDPParam.all_gather_inputs`: `.to(device)` then the cast to param_dtype) lives only inside
`foreach_all_gather`'s copy-in, a moment below the modelled ones (one layer's shard, A/dp, against a layer's
activations), as the non-offloaded flat copy-in buffer of the same size is.

Pinned host memory comes from the caching host allocator, which rounds each block up to a power of two
(`CachingHostAllocator.h`, default `pinned_max_round_threshold`): `host_pinned_bytes`.
Not measurable here: on a CPU mesh `CPUOffloadPolicy()` fails in `fully_shard` (`pin_memory()` needs an
accelerator) and with `pin_memory=False` every copy is a no-op (the device is the host), so the plan rejects
`--device cpu`.
"""

from __future__ import annotations

from llmem.components import Category
from llmem.components.optimizer import optimized_params, optimizer_step_temporary_bytes
from llmem.components.sharding import shard_summary
from llmem.plan import Offload, Optimizer, TrainingPlan
from llmem.spec import ModelSpec

GPUS_PER_NODE = 8  # ranks sharing one host's memory (a typical 8-GPU server; fewer when the job is smaller)
STEP_TENSOR_BYTES = 4


def is_offloaded(plan: TrainingPlan) -> bool:
    return plan.offload is Offload.OPTIMIZER_PARAMS


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else n


def host_breakdown(spec: ModelSpec, plan: TrainingPlan) -> dict:
    """Host bytes of one rank at its largest moment (the optimizer step), by category; empty when not offloaded."""
    if not is_offloaded(plan):
        return {}
    pb = plan.precision.param_bytes
    sizes = optimized_params(spec, plan)
    if plan.optimizer is Optimizer.SGD:
        states = sum(sizes) * pb
    else:  # exp_avg, exp_avg_sq and the 0-dim fp32 step, all on the host with the parameters
        states = 2 * sum(sizes) * pb + len(sizes) * STEP_TENSOR_BYTES
    return {
        Category.PARAMETERS: shard_summary(spec, plan).total * pb,
        Category.GRADIENTS: shard_summary(spec, plan).total * pb,
        Category.OPTIMIZER: states,
        Category.TEMPORARIES: optimizer_step_temporary_bytes(spec, plan),
    }


def host_pinned_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Pinned host memory of one rank: each sharded parameter and gradient block rounded up to a power of two."""
    if not is_offloaded(plan):
        return 0
    pb = plan.precision.param_bytes
    return 2 * sum(_pow2(n * pb) for n in shard_summary(spec, plan).sizes)


def ranks_per_node(plan: TrainingPlan) -> int:
    return min(plan.gpus, GPUS_PER_NODE)
