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

Kernel scratch (an allocation made and freed inside one call of an operator with its own CPU kernel) is left out
of the trace by the same rule as the counting allocator's (counting.py): it depends on the CPU's instruction set
and has no counterpart in the CUDA program. `with_scratch` keeps the full event series.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmem.measure.kernels import has_cpu_kernel

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
    scratch: dict[str, list[int]] = field(default_factory=dict)  # op -> [count, largest, total] left out
    with_scratch: CpuTrace | None = None  # every event, kernel scratch included

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
    """The CPU allocator events in time order, each with the chain of operator calls it happened in."""
    from torch._C._profiler import _EventType

    events: list[tuple[int, int, Alloc, tuple]] = []
    marks: list[tuple[int, str]] = []
    stack = [(node, ()) for node in reversed(prof.profiler.kineto_results.experimental_event_tree())]
    while stack:
        node, chain = stack.pop()
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            if f.device.type == "cpu" and f.alloc_size:
                op = chain[-1][0].name if chain else ""
                events.append((node.start_time_ns, len(events), Alloc(node.start_time_ns, f.ptr, f.alloc_size, op),
                               chain))
        elif node.name.startswith(_MARK_PREFIX):
            marks.append((node.start_time_ns, node.name))
        inner = chain + ((node, has_cpu_kernel(node.name)),) if node.tag == _EventType.TorchOp else chain
        stack.extend((c, inner) for c in reversed(node.children))
    events.sort(key=lambda e: (e[0], e[1]))
    marks.sort()
    program, scratch = _without_scratch(events)
    trace = CpuTrace(program, marks, scratch=scratch)
    trace.with_scratch = CpuTrace([e[2] for e in events], marks)
    return trace


def _common_kernel(a: tuple, b: tuple) -> str | None:
    """The innermost operator call in both chains, if it has its own CPU kernel: its name."""
    for (na, ka), (nb, _) in reversed(list(zip(a, b, strict=False))):
        if na is nb:
            return na.name if ka else None
    return None


def _without_scratch(events: list[tuple[int, int, Alloc, tuple]]) -> tuple[list[Alloc], dict[str, list[int]]]:
    """Drop each allocation freed inside the operator call (with a CPU kernel) that made it, and its free."""
    open_at: dict[int, int] = {}  # ptr -> index of its allocation event
    drop: set[int] = set()
    scratch: dict[str, list[int]] = {}
    for i, (_, _, ev, chain) in enumerate(events):
        if ev.size > 0:
            open_at[ev.ptr] = i
            continue
        j = open_at.pop(ev.ptr, None)
        op = _common_kernel(events[j][3], chain) if j is not None else None
        if op is not None:
            drop.update((i, j))
            s = scratch.setdefault(op, [0, 0, 0])
            s[0], s[1], s[2] = s[0] + 1, max(s[1], -ev.size), s[2] - ev.size
    return [e[2] for i, e in enumerate(events) if i not in drop], scratch
