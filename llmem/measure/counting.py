"""The default CPU tracker: a counting wrapper around c10's CPU allocator (cpu_alloc.cpp, built on first use).

It counts exactly what the CUDA caching allocator's `allocated_bytes` counts on a GPU — every storage and every
kernel scratch buffer, at the moment it is allocated or freed — and, unlike the profiler (cpu.py), it sees frees
on any thread: gloo releases some tensors on its worker threads, which left the profiler's total too high and
run-to-run different under DDP, ZeRO and FSDP2. Allocations made on other threads than the training thread
(gloo's scratch) are not counted (docs/DESIGN.md §1: communication buffers are outside `peak_bytes`).
The profiler tracker stays as the independent check (tests/measure) and as the timeline's source.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def extension():
    """The compiled extension (about 20 s the first time, then cached by torch in its extensions directory)."""
    from torch.utils.cpp_extension import load

    src = Path(__file__).with_name("cpu_alloc.cpp")
    return load("llmem_cpu_alloc", [str(src)], extra_cflags=["-O2"], verbose=bool(os.environ.get("LLMEM_DEBUG")))


def available() -> bool:
    try:
        extension()
        return True
    except Exception:  # no compiler: fall back to the profiler tracker
        return False


class CountingTracker:
    """`with CountingTracker() as t: ...; t.reset_peak(); ...` then `t.peak_bytes`, `t.live_at_reset`."""

    def __init__(self) -> None:
        self.ext = extension()
        self.peak_bytes = 0
        self.live_at_reset = 0
        self.end_bytes = 0

    def __enter__(self) -> CountingTracker:
        self.ext.start()
        return self

    def mark(self, name: str) -> None:
        pass

    def reset_peak(self) -> None:
        self.ext.reset_peak()
        self.live_at_reset = self.ext.current()

    def foreign_free_bytes(self) -> int:
        """Counted bytes freed on another thread (gloo's) since the reset: such a free lands at a moment that
        varies from run to run."""
        return int(self.ext.foreign_frees()[1])

    def __exit__(self, *exc) -> None:
        self.peak_bytes = self.ext.peak()
        self.end_bytes = self.ext.current()
        self.ext.stop()
