"""Memory outside the caching allocator's `max_memory_allocated`, shown apart from the peak (DESIGN.md section 1).

CUDA context: the driver's context plus the kernels of the CUDA libraries a training step loads (cuBLAS,
cuDNN, NCCL, PyTorch's own kernels) — commonly 0.5–1.3 GiB; we state 1 GiB on CUDA (the transformers memory
guide measured 1,343 MiB on a V100 with CUDA 11). The CPU profile has none.
The caching allocator's reserved-but-unallocated memory (`max_memory_reserved - max_memory_allocated`) is derived
from the allocator's rules in `llmem.components.reserved`.
"""

from __future__ import annotations

from llmem.plan import Device, TrainingPlan

GIB = 1 << 30
CUDA_CONTEXT_BYTES = 1 * GIB


def cuda_context_bytes(plan: TrainingPlan) -> int:
    return CUDA_CONTEXT_BYTES if plan.device is Device.CUDA else 0

