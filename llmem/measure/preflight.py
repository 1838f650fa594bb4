"""Before a CPU measurement starts: can its ranks fit in this machine's memory?

On CPU every rank's tensors live in the one host memory, so a run needs at least the estimator's per-rank peak
times the ranks, plus what each process holds before it allocates a tensor (Python, torch, transformers). A run
predicted to need more than the memory available now is refused before any worker starts, instead of swapping
for hours or being killed by the kernel part-way. Anything the estimate cannot say (a family it does not model,
no estimator) lets the run go ahead; so does LLMEM_SKIP_MEMORY_CHECK=1.
"""

from __future__ import annotations

import os

RANK_OVERHEAD_BYTES = 512 * 2**20  # a process with torch and transformers imported, before any tensor


def available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (memory that can be allocated without swapping), or None if unknown."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def predicted_peak_bytes(config: dict, plan) -> int | None:
    """The estimator's per-rank peak for `plan` on CPU, or None when it cannot say."""
    from llmem.errors import InputError

    try:
        from llmem.estimate import estimate
        from llmem.spec import ModelSpec

        return int(estimate(ModelSpec.from_config(config), plan).peak_bytes)
    except (ImportError, InputError):
        return None


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def host_memory_problem(config: dict, plan) -> str | None:
    """Why a CPU run of `plan` cannot fit in the memory available now (None: it may fit, or nothing is known)."""
    if str(getattr(plan.device, "value", plan.device)) != "cpu" or os.environ.get("LLMEM_SKIP_MEMORY_CHECK") == "1":
        return None
    peak = predicted_peak_bytes(config, plan)
    available = available_bytes()
    if peak is None or available is None:
        return None
    need = plan.gpus * (peak + RANK_OVERHEAD_BYTES)
    if need <= available:
        return None
    ranks = f"{plan.gpus} ranks × " if plan.gpus > 1 else ""
    return (f"a CPU run of this plan needs about {_gib(need)} of host memory ({ranks}{_gib(peak)} estimated peak "
            f"+ {_gib(RANK_OVERHEAD_BYTES)} per process) and {_gib(available)} is available; measure a smaller "
            f"model, --seq-len or --batch-size, fewer --gpus, or on a GPU with --device cuda")
