"""Memory outside the caching allocator's `max_memory_allocated`, shown apart from the peak (DESIGN.md section 1).

CUDA context: the driver's context plus the kernels of the CUDA libraries a training step loads (cuBLAS,
cuDNN, NCCL, PyTorch's own kernels) — commonly 0.5–1.3 GiB; we state 1 GiB on CUDA (the transformers memory
guide measured 1,343 MiB on a V100 with CUDA 11). The CPU profile has none.
Fragmentation allowance: the caching allocator rounds blocks up (512 B small, 2 MiB large segments) and keeps
freed blocks cached, so `max_memory_reserved` exceeds `max_memory_allocated`; we allow 5 % of the peak for the
plans outside `reserved.point_replays`; for those (the plans the request stream covers, full checkpointing only
under FSDP1) the allocator model's replay of the program's requests
gives the figure (`reserved.point_bytes`), and under `--alloc-conf expandable-segments` the allocator's rules
(`estimate._fragmentation_bytes`).
"""

from __future__ import annotations

from llmem.plan import Device, TrainingPlan

GIB = 1 << 30
CUDA_CONTEXT_BYTES = 1 * GIB
FRAGMENTATION_FRACTION = 0.05


def cuda_context_bytes(plan: TrainingPlan) -> int:
    return CUDA_CONTEXT_BYTES if plan.device is Device.CUDA else 0


def fragmentation_bytes(peak_bytes: int, plan: TrainingPlan) -> int:
    if plan.device is not Device.CUDA:
        return 0
    return int(peak_bytes * FRAGMENTATION_FRACTION)
