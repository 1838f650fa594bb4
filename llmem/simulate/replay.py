"""Replay a recorded allocation sequence through the caching-allocator model (llmem/simulate/allocator.py) and
report what torch.cuda's statistics would say after `reset_peak_memory_stats()` at the reset event."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class AllocatorStats:
    """What the replay predicts (bytes). `*_at_peak` are taken when allocated memory peaks after the reset."""

    max_allocated: int  # max_memory_allocated: rounded block sizes
    max_reserved: int  # max_memory_reserved
    allocated_at_peak: int
    reserved_at_peak: int
    segments: int  # segments (cudaMalloc calls or mapped pages) live at the end
    device_mallocs: int
    ooms: int  # allocations that needed cached segments released first (capacity given)
    reserved_at_reset: int = 0  # reserved when the peaks were reset: segments the build and wrap left cached

    @property
    def fragmentation_at_peak(self) -> int:
        """Reserved but not allocated when allocated memory peaks."""
        return self.reserved_at_peak - self.allocated_at_peak

    def to_dict(self) -> dict:
        return {"max_allocated": self.max_allocated, "max_reserved": self.max_reserved,
                "allocated_at_peak": self.allocated_at_peak, "reserved_at_peak": self.reserved_at_peak,
                "fragmentation_at_peak": self.fragmentation_at_peak, "segments": self.segments,
                "device_mallocs": self.device_mallocs, "ooms": self.ooms,
                "reserved_at_reset": self.reserved_at_reset}


def replay(events: list[tuple[int, int, int]], reset_index: int = 0, expandable_segments: bool = False,
           max_split_size: int | None = None, capacity: int | None = None,
           streams: Sequence[int] | None = None, empty_at_reset: bool = False, **settings) -> AllocatorStats:
    """Replay (op, block, delta) events; the peak statistics are reset before event `reset_index` (`empty_at_reset`:
    after `torch.cuda.empty_cache()`, as a program that empties the cache after wrapping, or builds on the meta
    device or the CPU, leaves nothing of the build cached).
    `streams[block]` is the stream block `block` was allocated on (default: all on stream 0); `settings` are the
    other `CachingAllocator` arguments (garbage_collection_threshold, memory_fraction, roundup_power2_divisions)."""
    from llmem.allocator import CachingAllocator

    alloc = CachingAllocator(expandable_segments, max_split_size, capacity, **settings)
    handles: dict = {}
    at_peak, at_reset = (0, 0), 0
    best = -1
    for i, (_, block, delta) in enumerate(events):
        if i == reset_index:
            if empty_at_reset:
                alloc.empty_cache()
            alloc.reset_peak()
            at_peak, best, at_reset = (alloc.allocated, alloc.reserved), alloc.allocated, alloc.reserved
        if delta > 0:
            handles[block] = alloc.malloc(delta, streams[block] if streams is not None else 0)
        else:
            alloc.free(handles.pop(block, None))
        if i >= reset_index and alloc.allocated > best:
            best = alloc.allocated
            at_peak = (alloc.allocated, alloc.reserved)
    if reset_index >= len(events):
        if empty_at_reset:
            alloc.empty_cache()
        alloc.reset_peak()
        at_peak = (alloc.allocated, alloc.reserved)
        at_reset = alloc.reserved
    return AllocatorStats(alloc.peak_allocated, alloc.peak_reserved, at_peak[0], at_peak[1], alloc.segment_count,
                          alloc.device_mallocs, alloc.ooms, at_reset)
