"""CUDA statistics: `max_memory_allocated()` / `max_memory_reserved()` after `reset_peak_memory_stats()`."""

from __future__ import annotations

import torch


class CudaTracker:
    """Same interface as CpuTracker: `mark`, `reset_peak`, then `peak_bytes` / `reserved_bytes`."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        self.baseline = 0
        self.peak_bytes = 0
        self.reserved_bytes = 0
        self.live_at_reset = 0

    def __enter__(self) -> CudaTracker:
        torch.cuda.synchronize(self.device)
        # Whatever this process holds before the model is built (normally 0) is not part of the plan's peak.
        self.baseline = torch.cuda.memory_allocated(self.device)
        return self

    def mark(self, name: str) -> None:
        pass

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.live_at_reset = torch.cuda.memory_allocated(self.device) - self.baseline

    def __exit__(self, *exc) -> None:
        torch.cuda.synchronize(self.device)
        self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self.baseline
        self.reserved_bytes = torch.cuda.max_memory_reserved(self.device)
