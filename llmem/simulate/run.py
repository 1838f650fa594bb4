"""Simulate one rank of a plan's training without memory: the real runtime (llmem.runtime: build, wrap, optimizer,
train_step) under `FakeTensorMode`, every allocation and free recorded, the sequence replayed through a model of the
CUDA caching allocator.

    sim = simulate(config, plan)          # config: a config.json dict; plan: TrainingPlan
    sim.peak_bytes, sim.peak_phase, sim.timeline, sim.top_tensors, sim.reserved_bytes, sim.to_dict()

Fake tensors are CPU tensors (fake CUDA tensors abort in autograd on a CPU-only torch build); what differs on CUDA
comes from the plan's explicit options (optimizer implementation, autocast dtype) — see docs/SIMULATION.md for the
rest. `--offload optimizer+params` runs on a fake accelerator instead, host and device apart (`fake_cuda.py`).
Multi-rank schemes run in this process with torch's fake process group ("fake" backend, FakeStore) at the plan's
world size, as rank `rank`. Classic DDP bucketing and ZeroRedundancyOptimizer do not run under fake tensors: their
model and gradients run as one rank would, the optimizer over this rank's ZeRO-1 partition, and the gradient
buckets are added from the closed-form model (marked `closed_form` wherever they show). `--pp` and DeepSpeed
ZeRO-1/2 run on the fake group too (`simulate/pipeline.py`, `simulate/deepspeed.py`), every rank unless one is asked.
"""


from __future__ import annotations

import contextlib
import importlib.util
import time
from collections.abc import Callable

from llmem.errors import InputError
from llmem.plan import Device, OptimizerImpl, Scheme, TrainingPlan
from llmem.simulate.result import LiveTensor, Phase, Simulation, build_result

__all__ = ["LiveTensor", "Phase", "Simulation", "simulate"]

DDP_SCHEMES = (Scheme.DDP, Scheme.ZERO1)
HOST_SCALAR_OPTIMIZERS = ("adafactor", "adamw8bit", "paged-adamw8bit")


def check_simulable(config: dict, plan: TrainingPlan) -> None:
    """The options a CPU fake run cannot run: InputError naming the option."""
    if str(plan.offload) == "optimizer":
        missing = "is not installed here, and " if importlib.util.find_spec("torchao") is None else ""
        raise InputError("offload", f"optimizer runs torchao's CPUOffloadOptimizer, which {missing}asserts a CUDA or "
                         "XPU device in its constructor (get_available_devices()[-1]), so it cannot run on fake "
                         "tensors here; measure it on a GPU (measure --device cuda)")
    if plan.activation_offload and plan.precision.is_mixed:
        raise InputError("precision", "activation offloading runs on the fake accelerator, which has no autocast "
                         "kernels (torch registers none for PrivateUse1 here); simulate it with --precision bf16 or "
                         "fp32 (torchtune trains in pure bf16), or measure it on a GPU (measure --device cuda)")
    if str(plan.loss) == "fused-linear-ce":
        raise InputError("loss", "fused-linear-ce runs Liger-Kernel's Triton kernels, which have no fake version; "
                         "measure it on a GPU (measure --device cuda)")
    if str(plan.engine) == "fsdp1" and plan.scheme is Scheme.ZERO2:
        raise InputError("engine", "FSDP1's SHARD_GRAD_OP does not run on fake tensors (its writeback check after a "
                         "forward that kept the flat parameter gathered reads storage sizes a fake tensor does not "
                         "have); measure it (measure --gpus N), or simulate --zero 3")
    if str(plan.engine) == "fsdp1" and str(plan.method) == "qlora":
        raise InputError("engine", "FSDP1 over a 4-bit base does not run on fake tensors (FSDP1 makes an "
                         "nn.Parameter of the fake Params4bit stand-in, whose detach() is a plain FakeTensor); "
                         "measure it (measure --gpus N), or simulate --engine torch")
    if plan.pp > 1 and plan.dp > 1:
        raise InputError("gpus", f"--gpus {plan.gpus} puts data parallelism beside --pp {plan.pp}: DDP's Reducer "
                         "cannot be built on fake tensors, and the simulation places its buckets in closed form only "
                         f"for plain DDP; measure it (measure --gpus {plan.gpus}), or simulate --gpus {plan.pp}")
    if plan.ddp_bucket_view and str(plan.scheme) in ("ddp", "zero1"):
        raise InputError("ddp-bucket-view", "the simulation places DDP's buckets in closed form and keeps each .grad "
                         "a tensor of its own (no Reducer runs on fake tensors); measure it (measure --gpus N)")


def _classic_ddp(plan: TrainingPlan) -> bool:
    """DDP and ZeRO-1 (run as one rank, buckets in closed form); FSDP1's NO_SHARD and DeepSpeed's ZeRO-1 run under
    the fake group."""
    return plan.scheme in DDP_SCHEMES and str(plan.engine) == "torch"


def default_rank(plan: TrainingPlan, config: dict | None = None) -> int:
    """The rank whose memory is the per-GPU figure: rank 0 (FSDP2 pads the last shards; TP ranks are equal),
    except ZeRO-1 where it is the rank with the largest partition (simulate() resolves it), and LoRA under FSDP1,
    where the rank whose shards hold the most adapter elements keeps the most optimizer states
    (`flat_param.largest_rank`). `--pp` and DeepSpeed without a rank: every rank (`_every_rank`)."""
    from llmem.components.lora import is_lora

    if config is not None and plan.engine.value == "fsdp1" and plan.gpus > 1 and is_lora(plan):
        from llmem.components.flat_param import largest_rank
        from llmem.spec import ModelSpec

        return largest_rank(ModelSpec.from_config(config), plan)
    return 0


@contextlib.contextmanager
def _fake_process_group(plan: TrainingPlan, rank: int):
    if plan.gpus == 1 or _classic_ddp(plan):
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
    head = _output_head(model)
    if head is not None:
        handles.append(head.register_forward_pre_hook(lambda *_: tracker.mark("loss")))
    return handles



@contextlib.contextmanager
def _simulation_context(plan: TrainingPlan, run_plan: TrainingPlan, sim_rank: int, tracker):
    """Everything active while the fake run goes: the fake process group, the patches, fake tensors, the tracker;
    one intra-op thread (as measure runs)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from llmem.simulate import patches
    from llmem.simulate.deepspeed import launcher_env
    from llmem.simulate.fake_cuda import fake_device
    from llmem.simulate.pipeline import fake_p2p_values
    from llmem.simulate.quant import fake_bnb_params

    patches.preload_imports(plan)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _fake_process_group(run_plan, sim_rank), patches.no_packed_sequence_check(_packed(run_plan, sim_rank)), \
                patches.real_device_mesh(), patches.untracked_sharding_propagation(tracker), \
                patches.cuda_kernel_choices(plan), patches.fake_parameter_conversion(), patches.fake_deepcopy(), \
                fake_bnb_params(plan), patches.bounded_fallback(), fake_p2p_values(plan, tracker), \
                launcher_env(plan, sim_rank), fake_device(plan, tracker), \
                patches.bnb_optimizer(plan, fake_mode, tracker) as paged_bytes, fake_mode, tracker:
            yield paged_bytes
    finally:
        torch.set_num_threads(threads)


def _phase_marks(plan, tracker, steps: int, buckets: list[int], progress) -> Callable[[str], None]:
    """The runtime's `mark`: the tracker's phase mark, the progress callback, DDP's bucket rebuild, and host scalars
    allowed inside the step of an optimizer that reads them (`.item()`: Adafactor, bitsandbytes) — with
    `--optimizer-in-backward` the steps run in backward, so there."""
    from llmem.simulate import ddp

    reads_host = str(plan.optimizer) in HOST_SCALAR_OPTIMIZERS
    step_phase = "backward" if plan.optimizer_in_backward else "optimizer"

    def mark(name: str) -> None:
        tracker.mark(name)
        tracker.host_scalars = reads_host and name == step_phase
        if progress is not None and name in ("forward", "pipeline", "backward", "optimizer"):
            progress(f"iteration {tracker.phases[-1][1]} of {steps}: {name}")
        if name == "forward" and buckets and tracker.phases[-1][1] == 2:
            ddp.rebuild_buckets(tracker, buckets)

    return mark


def _check(config: dict, plan: TrainingPlan, rank: int | None, steps: int) -> None:
    from llmem.runtime.parallel import check_supported

    if steps < 1:
        raise InputError("steps", f"must be at least 1, got {steps}")
    check_supported(str(config.get("model_type")), plan, config)
    check_simulable(config, plan)
    if rank is not None and not 0 <= rank < plan.gpus:
        raise InputError("rank", f"must be between 0 and {plan.gpus - 1}, got {rank}")


def simulate(config: dict, plan: TrainingPlan, rank: int | None = None, steps: int = 2,
             progress: Callable[[str], None] | None = None) -> Simulation:
    """Simulate `steps` iterations (DESIGN.md §1) of one rank of `plan` on the model `config` (a config.json dict).
    `progress(text)`, if given, is called as the run reaches each phase ("iteration 1 of 2: backward", ...)."""
    from llmem.runtime import Topology, prepare, train_step
    from llmem.runtime.optim import make_optimizer
    from llmem.simulate import ddp
    from llmem.simulate.fake_cuda import DEVICE, uses_fake_device
    from llmem.simulate.isolate import in_child, simulate_in_child
    from llmem.simulate.stand_ins import stand_ins
    from llmem.simulate.tracker import AllocationTracker

    _check(config, plan, rank, steps)
    if uses_fake_device(plan) and not in_child():
        return simulate_in_child(config, plan, rank, steps, progress)
    if rank is None and (plan.pp > 1 or plan.engine.value == "deepspeed"):
        return _every_rank(config, plan, steps, progress)
    t0 = time.perf_counter()
    is_ddp = _classic_ddp(plan)
    run_plan = plan.with_(gpus=1, zero=0) if is_ddp else plan
    sim_rank = rank if rank is not None else default_rank(plan, config)
    topo = Topology(rank=0 if is_ddp else sim_rank, world_size=run_plan.gpus,
                    device_type=DEVICE if uses_fake_device(plan) else "cpu")
    tracker = AllocationTracker()
    tracker.stand_ins = stand_ins()
    closed_form: list[str] = []
    step_blocks: list[int] = []
    with _simulation_context(plan, run_plan, sim_rank, tracker) as paged_bytes:
        if progress is not None:
            progress("building and wrapping the model on fake tensors")
        session = prepare(config, run_plan, topo, mark=tracker.mark)
        handles = _install_module_tracking(tracker, session.model)
        _install_tied_accumulation(tracker, session.model)
        buckets: list[int] = []
        if is_ddp:
            buckets, sim_rank, closed_form = ddp.install(session, plan, run_plan, rank, tracker, make_optimizer)
        mark = _phase_marks(plan, tracker, steps, buckets, progress)
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
    if progress is not None:
        progress("replaying the allocations through the caching-allocator model")
    notes = [f"{len(step_blocks)} optimizer step counters left out: on CUDA AdamW's (unless fused) and "
             "Adafactor's are host tensors"] if step_blocks else []
    if paged_bytes[0]:
        notes.append(f"paged optimizer states: {paged_bytes[0]:,} B in CUDA unified memory (bitsandbytes' "
                     "get_paged), outside the caching allocator and the peak")
    sim = build_result(plan, sim_rank, tracker, set(step_blocks), closed_form, notes, t0)
    sim.paged_state_bytes = paged_bytes[0]
    if tracker.device_type is not None:
        sim.host_bytes = tracker.host_peak
    return sim


def _every_rank(config: dict, plan: TrainingPlan, steps: int, progress) -> Simulation:
    """Ranks whose memory differs by more than padding, without `--rank`: each simulated, the worst returned with
    every rank's peak in `rank_peaks`. `--pp`: stage i on rank i (`stage_peaks`, as the estimate's); DeepSpeed
    ZeRO-1/2: each rank owns a different partition and reduces its gradients at a different bucket."""
    def ranked(r: int):
        return None if progress is None else (lambda text: progress(f"rank {r} of {plan.gpus}: {text}"))

    sims = [simulate(config, plan, rank=r, steps=steps, progress=ranked(r)) for r in range(plan.gpus)]
    worst = max(sims, key=lambda s: (s.peak_bytes, -s.rank))
    worst.rank_peaks = [s.peak_bytes for s in sims]
    worst.seconds = sum(s.seconds for s in sims)
    return worst


def _install_tied_accumulation(tracker, model) -> None:
    """The real `InputBuffer` decision for a tied weight's two gradients (`stand_ins.tied_accumulation`)."""
    from llmem.simulate.stand_ins import tied_accumulation

    inner = getattr(model, "module", model)
    if not hasattr(inner, "get_input_embeddings"):  # --pp: a stage (runtime.pipeline.Stage); pipelines are untied
        return
    emb, head = inner.get_input_embeddings(), inner.get_output_embeddings()
    if emb is None or head is None or getattr(head, "weight", None) is not getattr(emb, "weight", None):
        return
    tracker.stand_ins[_aten_add()] = tied_accumulation({tuple(emb.weight.shape)}, tracker.in_backward)


def _output_head(model):
    """The output head whose forward starts the `loss` phase: a pipeline stage's `lm_head` (None but on the last
    stage), else the (wrapped) model's output embeddings."""
    inner = getattr(model, "module", model)
    if not hasattr(inner, "get_output_embeddings"):
        return getattr(inner, "lm_head", None)
    return inner.get_output_embeddings()


def _aten_add():
    import torch

    return torch.ops.aten.add.Tensor


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


def _packed(plan, rank: int) -> bool:
    """Whether this rank's position ids look packed to transformers: under `--cp`, every rank of a group but the last
    (the head-tail load balancer gives rank r chunks r and 2·cp − 1 − r, adjacent only for r = cp − 1)."""
    return plan.cp > 1 and rank % plan.cp != plan.cp - 1
