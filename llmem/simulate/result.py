"""What one simulated rank gives back: the peak and its phase, the timeline, the phases, the largest live tensors
at the peak and the caching-allocator figures (`Simulation`), built from the tracker's events by `build_result`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from llmem.plan import TrainingPlan

TOP_TENSORS = 20


@dataclass(frozen=True)
class Phase:
    """A stretch of the run between two marks: its name, iteration (0 = build/wrap) and live bytes."""

    name: str
    iteration: int
    first_op: int
    start_bytes: int
    peak_bytes: int
    end_bytes: int


@dataclass(frozen=True)
class LiveTensor:
    """An allocation live at the peak and where it came from."""

    nbytes: int
    op: str
    module: str
    phase: str
    iteration: int
    shape: str
    closed_form: bool = False

    def to_dict(self) -> dict:
        return {"nbytes": self.nbytes, "op": self.op, "module": self.module, "phase": self.phase,
                "iteration": self.iteration, "shape": self.shape, "closed_form": self.closed_form}


@dataclass
class Simulation:
    """One rank's simulated step. Bytes are ints; `timeline` is [(op_index, live_bytes, phase)], one point per
    allocation or free from the peak reset on (DESIGN.md §1: after build and wrap)."""

    plan: TrainingPlan
    rank: int
    peak_bytes: int  # exact bytes, like the CPU tracker (max_memory_allocated without 512-B rounding)
    peak_phase: str
    peak_iteration: int
    peak_op_index: int
    live_at_reset: int
    timeline: list[tuple[int, int, str]]
    phases: list[Phase]
    top_tensors: list[LiveTensor]
    allocated_rounded_bytes: int  # max_memory_allocated as the caching allocator counts it (blocks)
    reserved_bytes: int  # predicted max_memory_reserved
    fragmentation_at_peak_bytes: int  # reserved minus allocated when allocated memory peaks
    reserved_expandable_bytes: int  # max_memory_reserved with expandable_segments:True
    reserved_at_reset_bytes: int = 0  # reserved when the peaks are reset: what build and wrap left cached
    reserved_emptied_bytes: int = 0  # max_memory_reserved of the run with the cache emptied at the reset (the
    #                                  estimate's point figure: nothing of the build cached)
    streams: int = 1  # CUDA streams the run allocated on (FSDP2: default, all-gather copy-in, reduce-scatter)
    paged_state_bytes: int = 0  # bitsandbytes' paged optimizer states in CUDA unified memory (not in the peak)
    host_bytes: int = 0  # --offload: the largest host tensor memory after the reset (fake_cuda.py), as estimate's
    closed_form: list[str] = field(default_factory=list)  # buffers added from the closed-form model
    rank_peaks: list[int] = field(default_factory=list)  # --pp / DeepSpeed without --rank: every rank's peak (this
    # Simulation is the worst rank's); under --pp rank i runs stage i

    @property
    def stage_peaks(self) -> list[int]:
        """--pp: each stage's peak (rank i runs stage i), as the estimate's `stage_peaks`."""
        return self.rank_peaks if self.plan.pp > 1 else []
    notes: list[str] = field(default_factory=list)
    ops: int = 0
    events: int = 0
    seconds: float = 0.0

    @property
    def fragmentation_bytes(self) -> int:
        """`max_memory_reserved - max_memory_allocated` (DESIGN.md §1), allocated as exact bytes."""
        return self.reserved_bytes - self.peak_bytes

    def timeline_points(self, max_points: int = 2000) -> list[tuple[int, int, str]]:
        """The timeline thinned to about `max_points`: per stretch the highest point, so the peak survives."""
        points = self.timeline
        if len(points) <= max_points:
            return list(points)
        step = -(-len(points) // max_points)
        return [max(points[i:i + step], key=lambda p: p[1]) for i in range(0, len(points), step)]

    def to_dict(self, max_points: int = 2000) -> dict:
        return {
            "plan": self.plan.to_dict(), "scheme": str(self.plan.scheme), "rank": self.rank,
            "peak_bytes": self.peak_bytes, "peak_phase": self.peak_phase, "peak_iteration": self.peak_iteration,
            "peak_op_index": self.peak_op_index, "live_at_reset": self.live_at_reset,
            "allocated_rounded_bytes": self.allocated_rounded_bytes, "reserved_bytes": self.reserved_bytes,
            "fragmentation_bytes": self.fragmentation_bytes,
            "fragmentation_at_peak_bytes": self.fragmentation_at_peak_bytes,
            "reserved_expandable_bytes": self.reserved_expandable_bytes,
            "reserved_at_reset_bytes": self.reserved_at_reset_bytes,
            "reserved_emptied_bytes": self.reserved_emptied_bytes, "streams": self.streams,
            "phases": [vars(p) for p in self.phases],
            "top_tensors": [t.to_dict() for t in self.top_tensors],
            "timeline": [list(p) for p in self.timeline_points(max_points)],
            "paged_state_bytes": self.paged_state_bytes, "host_bytes": self.host_bytes,
            "closed_form": self.closed_form, "notes": self.notes,
            "rank_peaks": self.rank_peaks, "stage_peaks": self.stage_peaks,
            "worst_stage": self.rank if self.stage_peaks else None,
            "ops": self.ops, "events": self.events, "seconds": round(self.seconds, 3),
        }



def _kept_events(tracker, drop: set) -> tuple[list, int, list[int]]:
    """The events without the dropped blocks, the reset's event index and each phase mark's event index, both
    moved to count only the kept events."""
    marks = [ev_index for (_, _, _, ev_index) in tracker.phases]
    reset, events = tracker.reset_event, tracker.events
    if not drop:
        return events, reset, marks
    kept_before, j = [], 0
    for ev in events:
        kept_before.append(j)
        j += ev[1] not in drop
    kept_before.append(j)
    return [ev for ev in events if ev[1] not in drop], kept_before[reset], [kept_before[m] for m in marks]


def _phase_of_events(n_events: int, marks: list[int]) -> list[int]:
    """For each event, the index of the last phase mark at or before it (-1 before the first)."""
    out, m, current = [], 0, -1
    for i in range(n_events):
        while m < len(marks) and marks[m] <= i:
            current, m = m, m + 1
        out.append(current)
    return out


def _phases(phases_raw, marks: list[int], series: list[int]) -> list[Phase]:
    out = []
    for k, (name, iteration, first_op, _) in enumerate(phases_raw):
        a = marks[k]
        b = marks[k + 1] if k + 1 < len(marks) else len(series)
        start = series[a - 1] if a > 0 else 0
        end = series[b - 1] if b > 0 else 0
        out.append(Phase(name, iteration, first_op, start, max([start, *series[a:b]]), end))
    return out


def _top_tensors(tracker, events, peak_i: int) -> list[LiveTensor]:
    """The largest allocations live right after event `peak_i`."""
    alive: dict[int, int] = {}
    for _, block, delta in events[: peak_i + 1]:
        if delta > 0:
            alive[block] = delta
        else:
            alive.pop(block, None)
    out = []
    for b in sorted(alive, key=lambda b: -alive[b])[:TOP_TENSORS]:
        info = tracker.blocks[b]
        ph = tracker.phases[info.phase] if info.phase >= 0 else ("build", 0, 0, 0)
        out.append(LiveTensor(alive[b], info.op, info.module, ph[0], ph[1], info.shape, info.closed_form))
    return out


def build_result(plan, rank, tracker, drop: set, closed_form, notes, t0: float) -> Simulation:
    """The Simulation of a finished run; blocks in `drop` (host-side tensors on CUDA) are left out."""
    from llmem.simulate.allocator import replay

    events, reset, marks = _kept_events(tracker, drop)
    phases_raw = tracker.phases
    live, series = 0, []
    for _, _, delta in events:
        live += delta
        series.append(live)
    phase_at = _phase_of_events(len(events), marks)
    live_at_reset = series[reset - 1] if reset > 0 else 0
    peak, peak_i = live_at_reset, reset - 1
    for i in range(reset, len(series)):
        if series[i] > peak:
            peak, peak_i = series[i], i

    def phase_name(k: int) -> str:
        return phases_raw[k][0] if k >= 0 else "start"

    peak_phase, peak_iter, peak_op = "start", 0, 0
    if peak_i >= 0:
        pk = phase_at[peak_i]
        peak_phase, peak_iter, peak_op = phase_name(pk), phases_raw[pk][1] if pk >= 0 else 0, events[peak_i][0]
    timeline = [(events[i][0], series[i], phase_name(phase_at[i])) for i in range(reset, len(events))]
    streams = [b.stream for b in tracker.blocks]  # each block's allocation stream (FSDP2's side streams)
    stats = replay(events, reset, streams=streams)
    expandable = replay(events, reset, expandable_segments=True, streams=streams)
    emptied = replay(events, reset, streams=streams, empty_at_reset=True)
    return Simulation(
        plan=plan, rank=rank, peak_bytes=peak, peak_phase=peak_phase, peak_iteration=peak_iter,
        peak_op_index=peak_op, live_at_reset=live_at_reset, timeline=timeline,
        phases=_phases(phases_raw, marks, series), top_tensors=_top_tensors(tracker, events, peak_i),
        allocated_rounded_bytes=stats.max_allocated, reserved_bytes=stats.max_reserved,
        fragmentation_at_peak_bytes=stats.fragmentation_at_peak, reserved_expandable_bytes=expandable.max_reserved,
        reserved_at_reset_bytes=stats.reserved_at_reset, reserved_emptied_bytes=emptied.max_reserved,
        streams=len(tracker.streams),
        closed_form=closed_form, notes=notes, ops=tracker.op_index, events=len(events),
        seconds=time.perf_counter() - t0,
    )
