"""The default CPU tracker: a counting wrapper around c10's CPU allocator (cpu_alloc.cpp, built on first use).

It counts what the CUDA caching allocator's `allocated_bytes` counts on a GPU — every storage, at the moment it
is allocated or freed — and, unlike the profiler (cpu.py), it sees frees on any thread: gloo releases some
tensors on its worker threads, which left the profiler's total too high and
run-to-run different under DDP, ZeRO and FSDP2. Allocations made on other threads than the training thread
(gloo's scratch) are not counted (docs/DESIGN.md §1: communication buffers are outside `peak_bytes`).
The profiler tracker stays as the independent check (tests/measure) and as the timeline's source.

Kernel scratch — memory a CPU operator's own kernel allocates and frees before it returns (oneDNN's bf16 gemm
buffers, LayerNorm backward's partial sums) — depends on the CPU's instruction set and has no counterpart in the
CUDA program the estimate describes. `peak_bytes` leaves it out (the program's tensors only: the same on every
CPU); `peak_bytes_with_scratch` keeps it, and `scratch()` says which operators made it.
"""

from __future__ import annotations

import hashlib
import os
import time
from functools import lru_cache
from pathlib import Path

SETTLE_S = 0.5  # for gloo's threads to let go of the last collective's tensors
STILL_S, STILL_MAX_S = 0.1, 3.0  # how long the live total must stay unchanged; the bound on that wait


@lru_cache(maxsize=1)
def extension():
    """The compiled extension (about 20 s the first time, then cached by torch in its extensions directory). One
    build directory per checkout (the name carries a digest of the source's path): torch 2.13's `load` keeps one
    build.ninja per name (`cpp_extension.py:2483`), which names the source by its path, so two checkouts sharing a
    name rebuilt it each time the other had built last."""
    from torch.utils.cpp_extension import load

    src = Path(__file__).resolve().with_name("cpu_alloc.cpp")
    name = f"llmem_cpu_alloc_v2_{hashlib.sha256(str(src).encode()).hexdigest()[:10]}"
    return load(name, [str(src)], extra_cflags=["-O2"], verbose=bool(os.environ.get("LLMEM_DEBUG")))


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
        self.peak_bytes = 0  # kernel scratch left out
        self.peak_bytes_with_scratch = 0
        self.live_at_reset = 0
        self.end_bytes = 0
        self._scratch: dict[str, tuple[int, int, int]] = {}
        self._at_peak: dict[str, tuple[int, int]] = {}

    def __enter__(self) -> CountingTracker:
        self.ext.start()
        return self

    def mark(self, name: str) -> None:
        pass

    def reset_peak(self) -> None:
        self.ext.reset_peak()

    def foreign_free_bytes(self) -> int:
        """Counted bytes freed on another thread (gloo's) since the reset: such a free lands at a moment that
        varies from run to run."""
        return int(self.ext.foreign_frees()[1])

    def scratch(self) -> dict[str, dict[str, int]]:
        """Kernel scratch freed since the reset, by operator: {op: {count, largest, total}} (bytes)."""
        return {op: dict(zip(("count", "largest", "total"), v, strict=True)) for op, v in sorted(self._scratch.items())}

    def live_at_peak(self) -> dict[str, dict[str, int]]:
        """The allocations live at the peak (scratch left out), by the operator that made each: {op: {count, bytes}}
        ("" for memory allocated outside any operator)."""
        return {op: dict(zip(("count", "bytes"), v, strict=True)) for op, v in sorted(self._at_peak.items())}

    def settle(self, timeout: float = SETTLE_S) -> None:
        """Wait (at most `timeout` s) until every counted allocation is freed. gloo's worker thread drops a finished
        collective's tensors (DDP's gradient bucket) a moment after the training thread has moved on; on a busy
        machine that moment can come after the row ended, and the bucket would be reported as never freed."""
        deadline = time.monotonic() + timeout
        while self.ext.current() > 0 and time.monotonic() < deadline:
            time.sleep(0.001)

    def wait_still(self, still: float = STILL_S, timeout: float = STILL_MAX_S) -> None:
        """Wait (at most `timeout` s) until the live total has not changed for `still` s: gloo's worker threads
        have dropped the tensors of the collectives that came before (nothing else runs meanwhile)."""
        start = last_change = time.monotonic()
        last = self.ext.current()
        while time.monotonic() - last_change < still and time.monotonic() - start < timeout:
            time.sleep(0.005)
            if (now := self.ext.current()) != last:
                last, last_change = now, time.monotonic()

    def __exit__(self, *exc) -> None:
        self.peak_bytes_with_scratch = self.ext.peak()
        self.live_at_reset, self.peak_bytes = self.ext.program_peak()
        self._scratch = dict(self.ext.scratch())
        self._at_peak = dict(self.ext.live_at_program_peak())
        self.end_bytes = self.ext.current()
        self.ext.stop()
