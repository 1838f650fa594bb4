"""`--engine deepspeed`: DeepSpeed 0.19.0's engine as the HF Trainer builds it (`deepspeed.initialize` with the
Trainer's model and its torch AdamW/SGD as the client optimizer, a ds_config with ZeRO's stage, bf16 when the plan
is bf16-mixed, every other ZeRO field at DeepSpeed's default), stepped as accelerate steps it
(`engine.backward(loss)`, then `engine.step()`, which steps, zeroes the gradients and all-gathers the new partitions).

On CPU DeepSpeed picks its CPU accelerator itself (`accelerator/real_accelerator.py`: the catch-all when no other
is found) and joins the gloo process group the launch already made (`deepspeed.init_distributed` keeps an
initialized torch.distributed)."""

from __future__ import annotations

import torch
from torch import nn

from llmem.errors import InputError
from llmem.plan import Precision, TrainingPlan


def ds_config(plan: TrainingPlan) -> dict:
    """The ds_config the Trainer hands DeepSpeed for `plan`: only what the plan sets, DeepSpeed's defaults for the
    rest (`runtime/zero/config.py`: reduce/allgather buckets 5e8 elements, contiguous gradients on, overlap_comm
    off for stages 1-2 unless the plan sets it; stage 0 builds no ZeRO optimizer and reads none of these)."""
    zero = {"stage": plan.zero, "reduce_bucket_size": plan.ds_reduce_bucket, "overlap_comm": plan.ds_overlap_comm}
    if plan.zero == 3:  # stage3_max_live_parameters and stage3_max_reuse_distance stay at DeepSpeed's 1e9
        zero.update(stage3_prefetch_bucket_size=plan.ds_prefetch_bucket,
                    stage3_param_persistence_threshold=plan.ds_persistence_threshold)
    return {
        "train_micro_batch_size_per_gpu": plan.batch_size,
        "gradient_accumulation_steps": plan.grad_accum,
        "zero_optimization": zero,
        "bf16": {"enabled": plan.precision is Precision.BF16_MIXED},
        "zero_allow_untested_optimizer": True,  # transformers' deepspeed_optim_sched sets it for its own optimizer
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def _one_rank_group(plan: TrainingPlan) -> None:
    """`--gpus 1`: DeepSpeed runs ZeRO with a data-parallel world of one (its launcher `deepspeed --num_gpus 1` sets
    RANK=0, WORLD_SIZE=1 and `init_distributed` makes the group, deepspeed/comm/comm.py:816-854). `measure` runs it
    under a one-process torchrun (`llmem.measure.launch`), which does the same; a run outside a launch (a session
    prepared in this process) gets the launcher's variables and a group of one here: gloo over an in-memory store."""
    import os

    import torch.distributed as dist

    if plan.gpus == 1 and not dist.is_initialized():
        for key in ("RANK", "LOCAL_RANK"):  # the engine reads LOCAL_RANK (engine.py asserts it is set)
            os.environ.setdefault(key, "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        backend = "gloo" if not torch.cuda.is_available() else "nccl"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def initialize(model: nn.Module, optimizer: torch.optim.Optimizer, plan: TrainingPlan):
    """The DeepSpeed engine over `model` (fp32; cast to bf16 by the engine under bf16) and its ZeRO optimizer."""
    import logging

    try:
        import deepspeed
    except ImportError:
        raise InputError("engine", "running --engine deepspeed needs the deepspeed package (scripts/setup.sh installs "
                         "it with the dev requirements); the estimate itself needs nothing more") from None
    import importlib

    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    # On CPU, DeepSpeed's TorchBackend JIT-builds a shared-memory op (`build_shm_op`, deepspeed/comm/torch.py:31,
    # ShareMemCommBuilder) used only by `inference_all_reduce`; the CUDA accelerator has no such builder. Not building
    # it keeps the measured training step the CUDA one and spares a compile of tens of seconds per fresh machine.
    # (`deepspeed.comm` binds the name `torch` to PyTorch itself: the module is taken from importlib, not by attribute.)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    _one_rank_group(plan)
    engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(plan))
    return engine, ds_optimizer
