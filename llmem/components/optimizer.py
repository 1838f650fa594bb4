"""Optimizer states and the temporaries of `optimizer.step()` (torch/optim/adamw.py, torch/optim/sgd.py, torch 2.13).

States, per parameter the rank optimizes, in the parameter's dtype:
  AdamW: exp_avg + exp_avg_sq = 2 * numel * param_bytes, plus a 0-dim fp32 `step` tensor per parameter tensor
         (on the device only for the fused implementation; on CPU otherwise, which the CPU profile counts).
  SGD (momentum 0.9): momentum_buffer = numel * param_bytes.
Step temporaries (beyond states, gradients and parameters):
  AdamW for-loop: `denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)` holds two copies of the largest tensor at once.
  AdamW foreach: `torch._foreach_sqrt(exp_avg_sqs)` allocates one copy of every parameter the rank optimizes.
  AdamW fused, SGD (all implementations): update in place, no temporaries.
LoRA: the optimizer gets only the trainable adapters (fp32 under every precision, `llmem.components.lora`).
"""

from __future__ import annotations

from llmem.components import lora
from llmem.components.sharding import shard_summary
from llmem.plan import Device, Optimizer, OptimizerImpl, Scheme, TrainingPlan
from llmem.spec import ModelSpec, ParamTensor, TpSplit

STEP_TENSOR_BYTES = 4  # torch.tensor(0.0, dtype=torch.float32)


def optimized_params(spec: ModelSpec, plan: TrainingPlan) -> list[int]:
    """Local element counts of the tensors this rank's optimizer updates (ZeRO-1: this rank's partition)."""
    if lora.is_lora(plan):
        return lora.adapter_sizes(spec, plan)
    sizes = list(shard_summary(spec, plan).sizes)
    if plan.scheme is not Scheme.ZERO1:
        return sizes
    return max(zero1_partitions(spec.params, plan.dp), key=sum)


def zero1_partitions(params: tuple[ParamTensor, ...], world: int) -> list[list[int]]:
    """`ZeroRedundancyOptimizer._partition_parameters`: tensors sorted by size, largest first, each to the rank
    with the least assigned so far (ties to the lowest rank)."""
    parts: list[list[int]] = [[] for _ in range(world)]
    totals = [0] * world
    for n in sorted((p.numel for p in params), reverse=True):
        r = totals.index(min(totals))
        parts[r].append(n)
        totals[r] += n
    return parts


def param_groups(spec: ModelSpec, plan: TrainingPlan) -> list[list[int]]:
    """Local sizes per optimizer parameter group (`llmem.runtime.optim.param_groups`): under TP the sharded
    DTensor parameters (TP-plan Linear weights and their biases) and the replicated plain ones form two groups, and
    a foreach step's temporaries are allocated and freed group by group. Other schemes: one group."""
    sizes = optimized_params(spec, plan)
    if plan.scheme is not Scheme.TP:
        return [sizes]
    row_split = {p.name.removesuffix(".weight") for p in spec.params if p.tp_split is TpSplit.ROWWISE}
    dtensor = [p.tp_split is not TpSplit.NONE or p.name.removesuffix(".bias") in row_split for p in spec.params]
    pairs = list(zip(sizes, dtensor, strict=True))
    groups = [[n for n, d in pairs if d], [n for n, d in pairs if not d]]
    return [g for g in groups if g]


def _state_bytes(plan: TrainingPlan) -> int:
    """Bytes per element of the optimized tensors (and so of their states and step temporaries)."""
    return lora.ADAPTER_BYTES if lora.is_lora(plan) else plan.precision.param_bytes


def _step_tensors_on_device(plan: TrainingPlan) -> bool:
    return plan.device is Device.CPU or plan.effective_optimizer_impl is OptimizerImpl.FUSED


def optimizer_state_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    sizes = optimized_params(spec, plan)
    pb = _state_bytes(plan)
    if plan.optimizer is Optimizer.SGD:
        return sum(sizes) * pb
    steps = len(sizes) * STEP_TENSOR_BYTES if _step_tensors_on_device(plan) else 0
    return 2 * sum(sizes) * pb + steps


def optimizer_step_temporary_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    if plan.optimizer is not Optimizer.ADAMW:
        return 0
    sizes = optimized_params(spec, plan)
    pb = _state_bytes(plan)
    impl = plan.effective_optimizer_impl
    if impl is OptimizerImpl.FORLOOP:
        return 2 * max(sizes, default=0) * pb
    if impl is OptimizerImpl.FOREACH:
        return max(sum(group) for group in param_groups(spec, plan)) * pb
    return 0
