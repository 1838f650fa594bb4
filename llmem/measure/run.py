"""Measure one plan on this rank: build + wrap, reset the peak, run the iterations, report the peak.

Used in-process for one rank and by every worker of a torchrun job (worker.py).
"""

from __future__ import annotations

import contextlib
import gc
import os
import time

import torch

from llmem.choices import Method, Optimizer
from llmem.measure import gloo_fence
from llmem.plan import AllocConf, TrainingPlan
from llmem.runtime import Topology, prepare, train_step


def collect() -> None:
    """Free unreachable cycles (a previous run's model) before and after a measurement, then move what survives —
    the modules torch and transformers import, a few hundred thousand objects — into the collector's permanent
    generation (`gc.freeze`), so that the next full collection scans only what was made since (0.5 s -> ~10 ms).
    A frozen object is still freed when its last reference goes; only a cycle it later joins waits."""
    gc.collect()
    gc.freeze()


def forget_process_caches() -> None:
    """Drop what a library makes once per process and keeps, so that each row measured in a shared process counts it
    as the first row of its own process would: bitsandbytes 0.50 caches the 256-entry fp32 map of its first
    blockwise quantization on the tensor's device (`functional.name2qmap["dynamic"]`, functional.py:654, made by
    double quantization's `quantize_blockwise` of the absmax). Without this a double-quantized row read 1,420 B less
    after another one in the same process (0.05 %, beyond the table's resolution)."""
    import sys

    functional = sys.modules.get("bitsandbytes.functional")
    if functional is not None:
        functional.name2qmap.clear()


def import_before_measuring(plan: TrainingPlan) -> None:
    """Make, before the tracker starts, the host-side tensors a library makes once per process, so that the first row
    measured in a process reads what every later one reads (without this a LoRA row read 144 B more, a 4-bit row
    396 B more, when first in its process):
    - `import bitsandbytes` makes its 16-entry nf4 and fp4 tables (`backends/utils.py:15,39`, 128 B);
    - `import peft` makes two 0-dim int64 default arguments (`tuners/loha/layer.py:368,391`, 16 B);
    - on CPU, bitsandbytes' 4-bit quantization caches its code and the code's midpoints and order on first use
      (`backends/utils.py:66-75`, `backends/default/ops.py:225-230`, 252 B); CUDA's kernels use neither cache.
    None of them is on the GPU in the CUDA program: the tables are made on the host, the caches only by CPU kernels."""
    import importlib.util

    uses_peft = plan.method is not Method.FULL
    uses_bnb = plan.method is Method.QLORA or plan.optimizer in (Optimizer.ADAMW8BIT, Optimizer.PAGED_ADAMW8BIT)
    if uses_peft and importlib.util.find_spec("peft") is not None:
        import peft  # noqa: F401
    if (uses_peft or uses_bnb) and importlib.util.find_spec("bitsandbytes") is not None:
        import bitsandbytes  # noqa: F401
        if plan.device.value == "cpu" and plan.quant.value in ("nf4", "fp4"):
            from bitsandbytes.backends.default import ops

            ops._get_4bit_quantize_bounds(plan.quant.value, torch.device("cpu"))


def make_tracker(device_type: str, topo: Topology):
    if device_type == "cuda":
        from llmem.measure.cuda import CudaTracker

        return CudaTracker(topo.device)
    from llmem.measure import counting

    if counting.available() and not os.environ.get("LLMEM_CPU_TRACKER") == "profiler":
        return counting.CountingTracker()
    from llmem.measure.cpu import CpuTracker

    return CpuTracker()


def _settle_setup(tracker) -> None:
    """Before the peak is reset, let gloo's worker threads drop the setup collectives' tensors (DDP's coalesced
    broadcast of the module states, TP's `distribute_tensor` of each weight): a barrier, then the tracker's wait
    until the live total is still (`CountingTracker.wait_still`). gloo runs two worker threads, so a barrier alone
    does not queue behind every earlier collective. Without it a loaded machine now and then left such a buffer
    alive into the measured iterations (a LoRA DDP row +13.5 MiB, a TP row +32 KiB)."""
    import torch.distributed as dist

    dist.barrier()
    if hasattr(tracker, "wait_still"):
        tracker.wait_still()


def measure_rank(config: dict, plan: TrainingPlan, steps: int = 2, topo: Topology | None = None,
                 tracker=None, mark_hook=None) -> dict:
    """This rank's figures: {rank, peak_bytes, live_at_reset, [reserved_bytes], seconds}.

    `tracker` defaults to the device's (counting allocator on CPU, CUDA statistics on CUDA); `mark_hook(session, mark)`
    may install extra phase marks (timeline.py) after wrapping.
    """
    topo = topo or Topology(device_type=plan.device.value)
    if topo.device_type == "cpu":
        # One intra-op thread: deterministic kernel scratch, and ranks do not fight over 2 cores.
        torch.set_num_threads(1)
    if topo.device_type == "cuda":
        torch.cuda.set_device(topo.device)
        if plan.alloc_conf is AllocConf.EXPANDABLE:  # --alloc-conf, before the first allocation of this process
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    forget_process_caches()
    import_before_measuring(plan)
    collect()
    tracker = tracker or make_tracker(topo.device_type, topo)
    start = time.perf_counter()
    with tracker:
        session = prepare(config, plan, topo, mark=tracker.mark)
        if mark_hook is not None:
            mark_hook(session, tracker.mark)
        # On CPU, gloo's frees land where the training thread drops its reference, as on CUDA (gloo_fence.py).
        fence = gloo_fence.fenced(session.model) if topo.device_type == "cpu" and topo.world_size > 1 \
            else contextlib.nullcontext()
        if topo.device_type == "cpu" and topo.world_size > 1:
            _settle_setup(tracker)
        tracker.reset_peak()
        with fence:
            for _ in range(steps):
                train_step(session, mark=tracker.mark)
        foreign = tracker.foreign_free_bytes() if hasattr(tracker, "foreign_free_bytes") else None
        del session
        collect()
        if topo.world_size > 1 and hasattr(tracker, "settle"):
            tracker.settle()
    result = {"rank": topo.rank, "peak_bytes": int(tracker.peak_bytes), "seconds": time.perf_counter() - start}
    if topo.device_type == "cuda":
        result["reserved_bytes"] = int(tracker.reserved_bytes)
        result["end_bytes"] = int(torch.cuda.memory_allocated(topo.device) - tracker.baseline)
    # Bytes still counted after everything was released (should be 0; more means missed frees).
    result["end_bytes"] = int(getattr(tracker, "end_bytes", 0) or result.get("end_bytes", 0))
    result["live_at_reset"] = int(tracker.live_at_reset)
    result["tracker"] = type(tracker).__name__
    if foreign is not None:  # counted bytes freed on gloo's threads during the iterations (0 when fenced)
        result["foreign_free_bytes"] = int(foreign)
    if hasattr(tracker, "peak_bytes_with_scratch"):  # CPU: the kernel scratch left out of peak_bytes (kernels.py)
        result["peak_bytes_with_scratch"] = int(tracker.peak_bytes_with_scratch)
    collect()
    return result
