"""The machine a CPU measurement ran on: CPU model, the instruction-set extensions oneDNN and ATen choose kernels
by, the thread count and the library versions — written into ACCURACY.md beside the figures.

The measured peaks leave kernel scratch out (kernels.py), so they do not depend on these; the record says where
the table was regenerated and lets a reader check that claim on another CPU (e.g. `ONEDNN_MAX_CPU_ISA=AVX2`).
"""

from __future__ import annotations

import os
from pathlib import Path

# The extensions that change which CPU kernels run for the dtypes llmem measures (bf16/fp16 gemm, AMX tiles).
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16",
             "amx_fp16")


def _cpuinfo() -> tuple[str, set[str]]:
    model, flags = "unknown CPU", set()
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == "unknown CPU":
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return model, flags


def describe() -> dict:
    """{cpu, isa, capability, onednn_max_cpu_isa, threads, torch, transformers} of this process."""
    import torch
    import transformers

    model, flags = _cpuinfo()
    return {"cpu": model, "isa": [f for f in ISA_FLAGS if f in flags],
            "capability": torch.backends.cpu.get_cpu_capability(),
            "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
            "threads": 1,  # measure_rank runs one intra-op thread per rank (run.py)
            "torch": torch.__version__, "transformers": transformers.__version__}


def summary(m: dict) -> str:
    """One line for ACCURACY.md."""
    isa = ", ".join(m["isa"]) or "none of " + ", ".join(ISA_FLAGS)
    cap = m["capability"] + (f", ONEDNN_MAX_CPU_ISA={m['onednn_max_cpu_isa']}" if m["onednn_max_cpu_isa"] else "")
    return (f"{m['cpu']} (ISA: {isa}; ATen CPU capability {cap}); {m['threads']} intra-op thread per rank; "
            f"torch {m['torch']}, transformers {m['transformers']}")
