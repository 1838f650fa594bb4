"""CPU peak of allocated tensor bytes, from the profiler's raw allocator events.

Why this tracker: on CPU, every tensor storage and every kernel-internal scratch buffer is allocated through
c10's CPU allocator, which reports each allocation and free (pointer, bytes) to the profiler when
`profile_memory=True` — the CPU analogue of what the CUDA caching allocator counts for
`max_memory_allocated()`. Frees of memory allocated before profiling started are not reported, so the profiler
runs from before the model is built; "reset the peak" is a marker, and the peak after it starts from the bytes
live at the marker (like `reset_peak_memory_stats()`).

The running total is kept here from the (pointer, size) events in time order; a free whose allocation was not
seen in this session (memory from before profiling) is ignored. Allocations on threads the profiler does not
follow (gloo's worker threads) are not reported; docs/DESIGN.md §1 keeps communication-library buffers out of
`peak_bytes` anyway.

`marks` are instantaneous `record_function` events: phase boundaries for the timeline (timeline.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

RESET = "llmem::reset_peak"
_MARK_PREFIX = "llmem::"


@dataclass
class Alloc:
    t: int  # profiler timestamp, ns
    ptr: int
    size: int  # > 0 allocation, < 0 free
    op: str  # the operator that allocated or freed it ("" outside any operator)


@dataclass
class CpuTrace:
    """The ordered allocator events and marks of one profiled run."""

    events: list[Alloc]
    marks: list[tuple[int, str]]  # (t, name), in time order
    series: list[int] = field(default_factory=list)  # live bytes after each event

    def __post_init__(self) -> None:
        live, sizes, series = 0, {}, []
        for ev in self.events:
            if ev.size > 0:
                sizes[ev.ptr] = ev.size
                live += ev.size
            else:
                live -= sizes.pop(ev.ptr, 0)
            series.append(live)
        self.series = series

    def _reset_index(self) -> int:
        """Index of the first event after the last reset mark (0 when there is none)."""
        resets = [t for t, name in self.marks if name == RESET]
        if not resets:
            return 0
        t0 = resets[-1]
        return next((i for i, ev in enumerate(self.events) if ev.t >= t0), len(self.events))

    def live_at(self, index: int) -> int:
        return self.series[index - 1] if index > 0 else 0

    @property
    def live_at_reset(self) -> int:
        return self.live_at(self._reset_index())

    @property
    def peak_bytes(self) -> int:
        """Largest live total at or after the reset (the reset value itself included)."""
        i = self._reset_index()
        return max([self.live_at(i), *self.series[i:]])

    @property
    def peak_index(self) -> int:
        i = self._reset_index()
        if not self.series[i:] or self.live_at(i) >= max(self.series[i:]):
            return i - 1
        return i + max(range(len(self.series) - i), key=lambda k: (self.series[i + k], -k))

    @property
    def end_bytes(self) -> int:
        return self.series[-1] if self.series else 0

    def live_allocations(self, index: int) -> dict[int, Alloc]:
        """Allocations live just after event `index` (pointer -> allocating event)."""
        live: dict[int, Alloc] = {}
        for ev in self.events[: index + 1]:
            if ev.size > 0:
                live[ev.ptr] = ev
            else:
                live.pop(ev.ptr, None)
        return live


class CpuTracker:
    """Context manager: profile allocator events; `mark(name)` phases; `reset_peak()`; `.trace` afterwards."""

    def __init__(self) -> None:
        self._prof = None
        self.trace: CpuTrace | None = None

    def __enter__(self) -> CpuTracker:
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False,
                             with_stack=False, acc_events=False)
        self._prof.__enter__()
        return self

    def mark(self, name: str) -> None:
        with torch.profiler.record_function(_MARK_PREFIX + name):
            pass

    def reset_peak(self) -> None:
        self.mark(RESET[len(_MARK_PREFIX):])

    def __exit__(self, *exc) -> None:
        self._prof.__exit__(*exc)
        self.trace = _parse(self._prof)
        self._prof = None

    @property
    def peak_bytes(self) -> int:
        return self.trace.peak_bytes

    @property
    def live_at_reset(self) -> int:
        return self.trace.live_at_reset

    @property
    def end_bytes(self) -> int:
        return self.trace.end_bytes


def _parse(prof) -> CpuTrace:
    from torch._C._profiler import _EventType

    events: list[tuple[int, int, Alloc]] = []
    marks: list[tuple[int, str]] = []
    seq = 0
    stack = list(reversed(prof.profiler.kineto_results.experimental_event_tree()))
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            if f.device.type == "cpu" and f.alloc_size:
                parent = node.parent
                events.append((node.start_time_ns, seq, Alloc(node.start_time_ns, f.ptr, f.alloc_size,
                                                               parent.name if parent is not None else "")))
                seq += 1
        elif node.name.startswith(_MARK_PREFIX):
            marks.append((node.start_time_ns, node.name))
        stack.extend(reversed(node.children))
    events.sort(key=lambda e: (e[0], e[1]))
    marks.sort()
    return CpuTrace([e[2] for e in events], marks)
