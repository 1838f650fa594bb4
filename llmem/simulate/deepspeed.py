"""`--engine deepspeed` (ZeRO-0/1/2/3) under fake tensors: DeepSpeed 0.19.0's engine and its ZeRO optimizer run
as they are (`llmem.runtime.deepspeed.initialize`, the step of `runtime.session.train_step`), as one rank on
torch's fake process group (docs/SIMULATION.md): the flat fp16/bf16/fp32 buffer, the partitions, the fp32 master
partition, the reduce buckets and the partition gradients are allocated by DeepSpeed's own code on fake tensors.
Its collectives (`all_reduce` of a bucket, `all_gather_into_tensor` of the new partitions) allocate nothing on the
fake group, as NCCL writes in place (gloo's CPU all-gather allocates an output of its own: not seen).
What a launcher would have set up is set up here (`launcher_env`). Two host reads run on fake tensors and change no
size: `partitioned_data.data_ptr()` (stage_1_and_2.py:468, an alignment assertion; a fake tensor's pointer is 0
with a deprecation warning, silenced here) and the overflow / norm `.item()`s, not reached with fp32 / bf16 (no
loss scaler, no gradient clipping in the Trainer's default ds_config). ZeRO-3's coordinator checks its recorded
trace against rank 0's (`assert_ints_same_as_other_ranks`, runtime/zero/utils.py:106, a broadcast read back with
`.item()`): a stand-in makes the same tensor and trusts the trace; its reduce-scatters allocate nothing on the
fake group (gloo copies its input on CPU)."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

from llmem.plan import TrainingPlan

GROUP_GLOBALS = ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                 "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "mpu",
                 "_ALL_TO_ALL_GROUP", "mesh_device", "_TENSOR_MODEL_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP",
                 "_DATA_PARALLEL_GROUP", "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE", "_MPU_TENSOR_MODEL_PARALLEL_RANK")


@contextlib.contextmanager
def launcher_env(plan: TrainingPlan, rank: int):
    """A fresh rank process as torchrun starts it, for each simulation in this process:
      * the environment torchrun gives each rank (`DeepSpeedEngine._do_args_sanity_check`, runtime/engine.py:1360,
        asserts `LOCAL_RANK`; `deepspeed.init_distributed` reads `RANK` / `WORLD_SIZE`);
      * stdout sent to stderr while DeepSpeed runs (its logger prints there);
      * DeepSpeed's process-wide state as at import: its communication backend (`deepspeed.comm.comm.cdb`) and
        the groups `deepspeed.utils.groups` caches (`_WORLD_GROUP`, ...), which would otherwise name the process
        group of the previous simulation, destroyed with it.
    Both restored afterwards."""
    if str(plan.engine) != "deepspeed":
        yield
        return
    with contextlib.redirect_stdout(sys.stderr):  # `simulate --json` prints its JSON alone on stdout
        yield from _launched(plan, rank)


def _launched(plan: TrainingPlan, rank: int):
    """`launcher_env`'s body, under stdout sent to stderr: DeepSpeed's logger writes to stdout (a handler on
    `sys.stdout` made at import, deepspeed/utils/logging.py; its accelerator warning comes at the first import)."""
    from deepspeed.comm import comm
    from deepspeed.utils import groups

    saved_groups = {name: _copy(getattr(groups, name)) for name in GROUP_GLOBALS}
    saved_cdb = comm.cdb
    env = {"LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": str(plan.gpus),
           "LOCAL_WORLD_SIZE": str(plan.gpus)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with warnings.catch_warnings(), _no_overflow():
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            yield
    finally:
        comm.cdb = saved_cdb
        for name, value in saved_groups.items():
            setattr(groups, name, _copy(value))
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _no_overflow():
    """ZeRO-0 under bf16 (`FP16_UnfusedOptimizer.step`) checks the gradients for inf/nan on the host:
    `CheckOverflow._has_inf_or_nan` reads `float(x.float().sum())` (runtime/utils.py:322) and `has_overflow`
    `overflow_gpu[0].item()` (:313), which a fake tensor cannot answer. The stand-ins make the same tensors (the fp32
    copy of a half gradient, the sum, the one-byte flag) and answer "no overflow", the steady state's step; likewise
    `get_weight_norm`'s `float(total_norm)` (runtime/utils.py:577): its per-gradient norms are made, 1.0 returned."""
    from unittest import mock

    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.utils import CheckOverflow

    def has_inf_or_nan(x, i):
        x.float().sum()
        return False

    def has_overflow(self, params, has_moe_params=None):
        self.has_overflow_serial(params)
        get_accelerator().ByteTensor([False])
        return False

    def get_weight_norm(parameters, norm_type=2, mpu=None):  # runtime/utils.py:563-577, `float(total_norm)` read
        total = sum(p.data.float().norm(norm_type) ** norm_type for p in parameters)
        get_accelerator().FloatTensor([0.0])
        return 1.0 if isinstance(total, torch.Tensor) else total

    def same_ints(ints):  # ZeRO-3's trace check (runtime/zero/utils.py:106): rank 0's ids broadcast, read back
        torch.tensor(ints, dtype=torch.int64)
        get_accelerator().device_name()

    with mock.patch.object(CheckOverflow, "_has_inf_or_nan", staticmethod(has_inf_or_nan)), \
            mock.patch.object(CheckOverflow, "has_overflow", has_overflow), \
            mock.patch("deepspeed.runtime.fp16.unfused_optimizer.get_weight_norm", get_weight_norm), \
            mock.patch("deepspeed.runtime.zero.partitioned_param_coordinator.assert_ints_same_as_other_ranks",
                       same_ints):
        yield


def _copy(value):
    return dict(value) if isinstance(value, dict) else value
