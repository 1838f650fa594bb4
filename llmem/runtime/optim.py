"""The optimizer of a plan: AdamW or SGD (momentum 0.9), implementation flags always explicit (DESIGN.md §2)."""

from __future__ import annotations

import functools
import weakref

import torch

from llmem.plan import Offload, Optimizer, OptimizerImpl, Scheme, TrainingPlan

LR = 1e-4
SGD_MOMENTUM = 0.9


def optimizer_class_and_kwargs(plan: TrainingPlan) -> tuple[type, dict]:
    """The class and keyword arguments; `foreach` and `fused` are both passed so torch never picks for us."""
    impl = plan.effective_optimizer_impl
    flags = {"foreach": impl is OptimizerImpl.FOREACH, "fused": impl is OptimizerImpl.FUSED}
    if plan.optimizer is Optimizer.ADAMW:
        return torch.optim.AdamW, {"lr": LR, **flags}
    if plan.optimizer is Optimizer.ADAFACTOR:  # no fused kernel; foreach=False is the for-loop (its default)
        return torch.optim.Adafactor, {"lr": LR, "foreach": flags["foreach"]}
    if plan.optimizer in (Optimizer.ADAMW8BIT, Optimizer.PAGED_ADAMW8BIT):
        import bitsandbytes as bnb  # imported only when asked for: an optional dependency

        cls = bnb.optim.PagedAdamW8bit if plan.optimizer is Optimizer.PAGED_ADAMW8BIT else bnb.optim.AdamW8bit
        return cls, {"lr": LR}
    return torch.optim.SGD, {"lr": LR, "momentum": SGD_MOMENTUM, **flags}


def param_groups(params, plan: TrainingPlan) -> list:
    """Under tensor parallelism (no FSDP) the sharded parameters are DTensors and the replicated ones (embeddings,
    norms, lm_head) plain tensors; torch's foreach and fused kernels cannot mix the two in one call, so they go in
    two parameter groups (sharded first). Every other scheme has one group."""
    params = list(params)
    if plan.scheme is not Scheme.TP:
        return params
    from torch.distributed.tensor import DTensor

    sharded = [p for p in params if isinstance(p, DTensor)]
    plain = [p for p in params if not isinstance(p, DTensor)]
    return [{"params": group} for group in (sharded, plain) if group]


def make_optimizer(params, plan: TrainingPlan, zero1: bool = False):
    cls, kwargs = optimizer_class_and_kwargs(plan)
    if plan.offload is Offload.OPTIMIZER:
        # torchao's single-GPU optimizer offload (CUDA/XPU only, so not a dependency of this CPU build): the host
        # optimizer gets the same explicit flags; gradients leave the GPU too unless accumulation needs them there.
        from torchao.optim import CPUOffloadOptimizer

        return CPUOffloadOptimizer(list(params), optimizer_class=cls, offload_gradients=plan.grad_accum == 1,
                                   **kwargs)
    if zero1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=cls, **kwargs)
    return cls(param_groups(params, plan), **kwargs)


class InBackward:
    """`--optimizer-in-backward`, as torchtune runs it (training/memory.py `create_optim_in_bwd_wrapper`,
    `register_optim_in_bwd_hooks`): one optimizer per trainable parameter, `{p: Optimizer([p], ...)}`, and on each
    parameter a post-accumulate-grad hook that calls its optimizer's `step()` then `zero_grad()` (set_to_none), so a
    gradient is freed as soon as its step ran. FSDP2 calls the same hooks on the sharded parameters once their
    reduce-scatter output is assigned (`_fsdp_collectives.py: foreach_reduce`). `step` and `zero_grad` of the
    iteration have nothing left to do; `state` is every optimizer's, for the simulation's step counters. A hook
    holds its optimizer by a weak reference: a parameter's hooks live in a dict the garbage collector does not walk,
    so a strong one (parameter -> hook -> optimizer -> parameter) would keep the model and its states alive after
    the session (the same allocations either way)."""

    def __init__(self, params, plan: TrainingPlan) -> None:
        self.optimizers = {p: make_optimizer([p], plan) for p in params}
        self.handles = [p.register_post_accumulate_grad_hook(functools.partial(_step_and_zero, weakref.ref(o)))
                        for p, o in self.optimizers.items()]

    @property
    def state(self) -> dict:
        return {p: s for o in self.optimizers.values() for p, s in o.state.items()}


def _step_and_zero(optimizer_ref, _param) -> None:
    optimizer = optimizer_ref()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
