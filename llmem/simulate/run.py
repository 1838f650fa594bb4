"""Simulate one rank of a plan's training without memory: the real runtime (llmem.runtime: build, wrap, optimizer,
train_step) under `FakeTensorMode`, every allocation and free recorded, the sequence replayed through a model of the
CUDA caching allocator.

    sim = simulate(config, plan)          # config: a config.json dict; plan: TrainingPlan
    sim.peak_bytes, sim.peak_phase, sim.timeline, sim.top_tensors, sim.reserved_bytes, sim.to_dict()

Fake tensors are CPU tensors (fake CUDA tensors do not work on a CPU-only torch build); what differs on CUDA comes
from the plan's explicit options (optimizer implementation, autocast dtype) — see docs/SIMULATION.md for the rest.
Multi-rank schemes run in this process with torch's fake process group ("fake" backend, FakeStore) at the plan's
world size, as rank `rank`. Classic DDP bucketing and ZeroRedundancyOptimizer do not run under fake tensors: their
model and gradients run as one rank would, the optimizer over this rank's ZeRO-1 partition, and the gradient
buckets are added from the closed-form model (marked `closed_form` wherever they show).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from llmem.errors import InputError
from llmem.plan import Device, OptimizerImpl, Scheme, TrainingPlan

DDP_SCHEMES = (Scheme.DDP, Scheme.ZERO1)
DDP_FIRST_BUCKET_BYTES = 1 << 20  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
DDP_BUCKET_BYTES = 25 << 20  # DistributedDataParallel(bucket_cap_mb=25)
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
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
    closed_form: list[str] = field(default_factory=list)  # buffers added from the closed-form model
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
            "phases": [vars(p) for p in self.phases],
            "top_tensors": [t.to_dict() for t in self.top_tensors],
            "timeline": [list(p) for p in self.timeline_points(max_points)],
            "closed_form": self.closed_form, "notes": self.notes,
            "ops": self.ops, "events": self.events, "seconds": round(self.seconds, 3),
        }


def check_simulable(config: dict, plan: TrainingPlan) -> None:
    method = str(getattr(plan, "method", "full"))
    if method != "full":
        raise InputError("method", f"{method}: PEFT's adapter layers cannot be moved onto fake parameters "
                         "(`Module._apply` refuses to swap them); the simulation runs --method full only")
    optimizer = str(plan.optimizer)
    if optimizer not in ("adamw", "sgd"):
        raise InputError("optimizer", f"{optimizer}: its step reads tensor values on the host (`.item()`), which "
                         "fake tensors do not have; the simulation runs adamw and sgd — use estimate or measure")
    if str(plan.offload) != "none":
        raise InputError("offload", "FSDP2's CPUOffloadPolicy pins host memory, which needs a CUDA device; the "
                         "simulation runs on CPU fake tensors — use estimate")
    if str(plan.loss) != "standard":
        raise InputError("loss", "fused-linear-ce runs Liger-Kernel's Triton kernels (CUDA only); the simulation "
                         "runs on CPU fake tensors — use estimate")
    if any(config.get(k) for k in MOE_KEYS):
        raise InputError("model", "mixture-of-experts routing depends on the data (and its grouped matmul refuses "
                         "fake fp32 tensors); the simulation does not run MoE models — use estimate or measure")


def default_rank(plan: TrainingPlan) -> int:
    """The rank whose memory is the per-GPU figure: rank 0 (FSDP2 pads the last shards; TP ranks are equal),
    except ZeRO-1 where it is the rank with the largest partition (simulate() resolves it)."""
    return 0


@contextlib.contextmanager
def _fake_process_group(plan: TrainingPlan, rank: int):
    if plan.gpus == 1 or plan.scheme in DDP_SCHEMES:
        yield
        return
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised; simulate() needs its own fake one")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.gpus)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _real_device_mesh():
    """Device meshes compute their rank map and coordinates with tensor ops and read them back (`tolist`,
    `nonzero`): build them outside the fake and tracking modes (the runtime's `wrap` and FSDP2's TP x FSDP2
    sharding build them; these patches are only active while simulating)."""
    from torch.distributed import device_mesh
    from torch.utils._python_dispatch import _disable_current_modes

    orig_init_mesh, orig_init = device_mesh.init_device_mesh, device_mesh.DeviceMesh.__init__

    def init_device_mesh(*args, **kwargs):
        with _disable_current_modes():
            return orig_init_mesh(*args, **kwargs)

    def init(self, *args, **kwargs):
        with _disable_current_modes():
            orig_init(self, *args, **kwargs)

    device_mesh.init_device_mesh, device_mesh.DeviceMesh.__init__ = init_device_mesh, init
    try:
        yield
    finally:
        device_mesh.init_device_mesh, device_mesh.DeviceMesh.__init__ = orig_init_mesh, orig_init


@contextlib.contextmanager
def _untracked_sharding_propagation(tracker):
    """DTensor's sharding propagation builds fake copies of its arguments to infer output metadata
    (`OpSchema.gen_fake_args`); a real run makes them under its own fake mode, never on the device."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    orig = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self, *args, **kwargs):
        tracker.paused += 1
        try:
            return orig(self, *args, **kwargs)
        finally:
            tracker.paused -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = orig


@contextlib.contextmanager
def _cuda_kernel_choices(plan: TrainingPlan):
    """On the cuda profile, take the branches CUDA takes where CPU code paths differ in memory:
      * `F.dropout`: `at::native::dropout` runs the fused `native_dropout` (bool mask saved) only on CUDA; on
        CPU `_dropout_impl` saves a noise tensor in the input's dtype;
      * `F.scaled_dot_product_attention` with dropout: CUDA's flash / memory-efficient kernels apply dropout
        inside (philox seed and offset only); the CPU flash kernel refuses dropout and the math path would run.
        The simulation calls it with dropout_p = 0, which allocates what the fused kernels do."""
    if plan.device is not Device.CUDA:
        yield
        return
    import torch
    from torch.nn import functional

    orig_dropout, orig_sdpa = functional.dropout, functional.scaled_dot_product_attention

    def dropout(input, p=0.5, training=True, inplace=False):
        if inplace or not training or p == 0 or input.numel() == 0:
            return orig_dropout(input, p, training, inplace)
        return torch.native_dropout(input, p, True)[0]

    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, *args, **kwargs):
        return orig_sdpa(query, key, value, attn_mask, 0.0, *args, **kwargs)

    functional.dropout, functional.scaled_dot_product_attention = dropout, scaled_dot_product_attention
    try:
        yield
    finally:
        functional.dropout, functional.scaled_dot_product_attention = orig_dropout, orig_sdpa


@contextlib.contextmanager
def _no_packed_sequence_check():
    """transformers treats fake tensors as traced and would build an explicit float mask per layer; the
    packed-sequence check is what sends it there (position ids 0..s-1 are never packed)."""
    from transformers import masking_utils

    orig = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = orig


def zero1_partitions(params: list, world: int) -> list[list]:
    """`ZeroRedundancyOptimizer._partition_parameters`: largest first, each to the least-loaded rank."""
    parts: list[list] = [[] for _ in range(world)]
    totals = [0] * world
    for p in sorted(params, key=lambda t: t.numel(), reverse=True):
        r = totals.index(min(totals))
        parts[r].append(p)
        totals[r] += p.numel()
    return parts


class _PartitionOptimizer:
    """ZeRO-1 seen from one rank: the local optimizer steps this rank's partition; zero_grad clears every grad
    (ZeroRedundancyOptimizer's param_groups hold all parameters). The broadcast after the step is in place."""

    def __init__(self, local, all_params: list) -> None:
        self.local, self.all_params = local, all_params
        self.state = local.state

    def step(self):
        self.local.step()

    def zero_grad(self, set_to_none: bool = True):
        for p in self.all_params:
            p.grad = None


def ddp_buckets(params: list) -> list[int]:
    """Bytes of each DDP gradient bucket (`Reducer::initialize_buckets` via `_compute_bucket_assignment_by_size`):
    parameters in reverse order, a bucket closes once it reaches its cap (1 MiB for the first, 25 MiB after)."""
    sizes, cur, cap = [], 0, DDP_FIRST_BUCKET_BYTES
    for p in reversed(params):
        cur += p.numel() * p.element_size()
        if cur >= cap:
            sizes.append(cur)
            cur, cap = 0, DDP_BUCKET_BYTES
    if cur:
        sizes.append(cur)
    return sizes


def _install_module_tracking(tracker, model) -> list:
    """Module names for the tracker: a stack through forward (global hooks), and in backward the module whose
    outputs' gradients arrived last (a multi-grad hook on each module's outputs)."""
    import torch
    from torch.autograd.graph import register_multi_grad_hook
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    names = {id(m): n for n, m in model.named_modules()}
    stack: list[str] = []

    def pre(module, _args):
        stack.append(names.get(id(module), tracker.module))
        tracker.module = stack[-1]

    def post(module, _args, output):
        if stack:
            stack.pop()
        tracker.module = stack[-1] if stack else ""
        if torch.is_grad_enabled():
            outs = [t for t in (output if isinstance(output, (tuple, list)) else (output,))
                    if isinstance(t, torch.Tensor) and t.requires_grad]
            if outs:
                name = names.get(id(module), "")

                def arrived(_grads, name=name):
                    tracker.module = name

                register_multi_grad_hook(outs, arrived, mode="any")

    handles = [register_module_forward_pre_hook(pre), register_module_forward_hook(post)]
    head = getattr(model, "module", model).get_output_embeddings()
    if head is not None:
        handles.append(head.register_forward_pre_hook(lambda *_: tracker.mark("loss")))
    return handles


def simulate(config: dict, plan: TrainingPlan, rank: int | None = None, steps: int = 2,
             progress: Callable[[str], None] | None = None) -> Simulation:
    """Simulate `steps` iterations (DESIGN.md §1) of one rank of `plan` on the model `config` (a config.json dict).
    `progress(text)`, if given, is called as the run reaches each phase ("iteration 1 of 2: backward", ...)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from llmem.runtime import Topology, prepare, train_step
    from llmem.runtime.optim import make_optimizer
    from llmem.runtime.parallel import check_supported
    from llmem.simulate.tracker import AllocationTracker

    if steps < 1:
        raise InputError("steps", f"must be at least 1, got {steps}")
    check_supported(str(config.get("model_type")), plan, config)
    check_simulable(config, plan)
    if rank is not None and not 0 <= rank < plan.gpus:
        raise InputError("rank", f"must be between 0 and {plan.gpus - 1}, got {rank}")
    t0 = time.perf_counter()
    ddp = plan.scheme in DDP_SCHEMES
    run_plan = plan.with_(gpus=1, zero=0) if ddp else plan
    sim_rank = rank if rank is not None else default_rank(plan)
    topo = Topology(rank=0 if ddp else sim_rank, world_size=run_plan.gpus, device_type="cpu")
    tracker = AllocationTracker()
    closed_form: list[str] = []
    notes: list[str] = []
    step_blocks: list[int] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _fake_process_group(run_plan, sim_rank), _no_packed_sequence_check(), _real_device_mesh(), \
                _untracked_sharding_propagation(tracker), _cuda_kernel_choices(plan), \
                FakeTensorMode(allow_non_fake_inputs=True), tracker:
            if progress is not None:
                progress("building and wrapping the model on fake tensors")
            session = prepare(config, run_plan, topo, mark=tracker.mark)
            handles = _install_module_tracking(tracker, session.model)
            buckets: list[int] = []
            if ddp:
                params = [p for p in session.model.parameters() if p.requires_grad]
                tracker.module = "DistributedDataParallel"
                buckets = [tracker.add_block(b, "closed form: DDP gradient bucket", f"{b} B", closed_form=True)
                           for b in ddp_buckets(params)]
                closed_form.append(f"DDP gradient buckets: {len(buckets)} of {sum(ddp_buckets(params)):,} B in "
                                   "all, allocated at wrap (Reducer::initialize_buckets) and rebuilt at the start "
                                   "of iteration 2's forward, new before old (Reducer::rebuild_buckets)")
                if plan.scheme is Scheme.ZERO1:
                    parts = zero1_partitions(params, plan.dp)
                    if rank is None:
                        sim_rank = max(range(plan.dp), key=lambda r: (sum(p.numel() for p in parts[r]), -r))
                    local = make_optimizer(parts[sim_rank], run_plan)
                    session.optimizer = _PartitionOptimizer(local, params)
                    closed_form.append(f"ZeRO-1: ZeroRedundancyOptimizer's partition of rank {sim_rank} "
                                       f"({len(parts[sim_rank])} of {len(params)} tensors) stepped by a plain "
                                       "optimizer")
                tracker.module = ""
            base_mark = tracker.mark

            def mark(name: str) -> None:
                base_mark(name)
                if progress is not None and name in ("forward", "backward", "optimizer"):
                    progress(f"iteration {tracker.phases[-1][1]} of {steps}: {name}")
                if name == "forward" and buckets and tracker.phases[-1][1] == 2:
                    tracker.module = "DistributedDataParallel"
                    new = [tracker.add_block(tracker.blocks[b].nbytes, "closed form: DDP bucket rebuild",
                                             tracker.blocks[b].shape, closed_form=True) for b in buckets]
                    for b in buckets:
                        tracker.free_block(b)
                    buckets[:] = new
                    tracker.module = ""

            tracker.reset_peak()
            for _ in range(steps):
                train_step(session, mark=mark)
            if _step_tensors_on_host(plan):
                step_blocks = _step_tensor_blocks(session.optimizer, tracker)
            for h in handles:
                h.remove()
            for b in buckets:
                tracker.free_block(b)
            del session
    finally:
        torch.set_num_threads(threads)
    if progress is not None:
        progress("replaying the allocations through the caching-allocator model")
    if step_blocks:
        notes.append(f"{len(step_blocks)} AdamW step counters left out: on CUDA they are host tensors unless "
                     "the implementation is fused")
    return _result(plan, sim_rank, tracker, set(step_blocks), closed_form, notes, t0)


def _step_tensors_on_host(plan: TrainingPlan) -> bool:
    return plan.device is Device.CUDA and plan.effective_optimizer_impl is not OptimizerImpl.FUSED


def _step_tensor_blocks(optimizer, tracker) -> list[int]:
    out = []
    for state in getattr(optimizer, "state", {}).values():
        step = state.get("step") if isinstance(state, dict) else None
        if step is not None and hasattr(step, "untyped_storage"):
            entry = tracker._live.get(step.untyped_storage()._cdata)
            if entry is not None and entry[0] >= 0:
                out.append(entry[0])
    return out


def _result(plan, rank, tracker, drop: set, closed_form, notes, t0: float) -> Simulation:
    from llmem.simulate.allocator import replay

    reset = tracker.reset_event
    events = tracker.events
    if drop:  # keep the reset position right while dropping events
        reset = sum(1 for ev in events[:reset] if ev[1] not in drop)
        events = [ev for ev in events if ev[1] not in drop]
    phases_raw = tracker.phases
    # live bytes after each event, the phase of each event
    phase_at = []
    marks = [(ev_index, k) for k, (_, _, _, ev_index) in enumerate(phases_raw)]
    # recompute event indices of the marks after dropping
    if drop:
        kept_before, j = [], 0
        for ev in tracker.events:
            kept_before.append(j)
            if ev[1] not in drop:
                j += 1
        kept_before.append(j)
        marks = [(kept_before[ev_index], k) for ev_index, k in marks]
    live, series = 0, []
    for _, _, delta in events:
        live += delta
        series.append(live)
    m = 0
    current = -1
    for i in range(len(events)):
        while m < len(marks) and marks[m][0] <= i:
            current = marks[m][1]
            m += 1
        phase_at.append(current)
    live_at_reset = series[reset - 1] if reset > 0 else 0
    peak, peak_i = live_at_reset, reset - 1
    for i in range(reset, len(series)):
        if series[i] > peak:
            peak, peak_i = series[i], i

    def phase_name(k: int) -> str:
        return phases_raw[k][0] if k >= 0 else "start"

    if peak_i >= 0:
        pk = phase_at[peak_i]
        peak_phase, peak_iter, peak_op = phase_name(pk), phases_raw[pk][1] if pk >= 0 else 0, events[peak_i][0]
    else:
        peak_phase, peak_iter, peak_op = "start", 0, 0
    timeline = [(events[i][0], series[i], phase_name(phase_at[i])) for i in range(reset, len(events))]

    # phases with their live bytes
    phases: list[Phase] = []
    for k, (name, iteration, first_op, _) in enumerate(phases_raw):
        a = marks[k][0]
        b = marks[k + 1][0] if k + 1 < len(marks) else len(events)
        start = series[a - 1] if a > 0 else 0
        top = max([start, *series[a:b]])
        end = series[b - 1] if b > 0 else 0
        phases.append(Phase(name, iteration, first_op, start, top, end))

    # live blocks at the peak
    alive: dict[int, int] = {}
    for _, block, delta in events[: peak_i + 1]:
        if delta > 0:
            alive[block] = delta
        else:
            alive.pop(block, None)
    top = sorted(alive, key=lambda b: -alive[b])[:TOP_TENSORS]
    top_tensors = []
    for b in top:
        info = tracker.blocks[b]
        ph = phases_raw[info.phase] if info.phase >= 0 else ("build", 0, 0, 0)
        top_tensors.append(LiveTensor(alive[b], info.op, info.module, ph[0], ph[1], info.shape, info.closed_form))

    stats = replay(events, reset)
    expandable = replay(events, reset, expandable_segments=True)
    return Simulation(
        plan=plan, rank=rank, peak_bytes=peak, peak_phase=peak_phase, peak_iteration=peak_iter,
        peak_op_index=peak_op, live_at_reset=live_at_reset, timeline=timeline, phases=phases,
        top_tensors=top_tensors, allocated_rounded_bytes=stats.max_allocated, reserved_bytes=stats.max_reserved,
        fragmentation_at_peak_bytes=stats.fragmentation_at_peak, reserved_expandable_bytes=expandable.max_reserved,
        closed_form=closed_form, notes=notes, ops=tracker.op_index, events=len(events),
        seconds=time.perf_counter() - t0,
    )
