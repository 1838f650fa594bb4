"""Which operators run a CPU kernel of their own: what such a kernel allocates and frees before it returns is its
scratch, which depends on the CPU (oneDNN's bf16 gemm buffers, LayerNorm backward's partial sums) and has no
counterpart in the CUDA program the estimate describes. Both CPU trackers (counting.py, cpu.py) leave it out.

An operator counts as a kernel when any overload of its name has a kernel registered for the `CPU` dispatch key
(composites — CompositeImplicitAutograd / CompositeExplicitAutograd — decompose into other operators, which run
the same way on CUDA); c10d collectives are communication, kept apart (docs/DESIGN.md §1).
"""

from __future__ import annotations

import torch

_known: dict[str, bool] = {}
_kernels: set[str] = set()


def _read_dispatcher() -> None:
    _kernels.clear()
    for op in torch._C._dispatch_get_all_op_names():
        if torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU"):
            _kernels.add(op.split(".")[0])


def has_cpu_kernel(name: str) -> bool:
    """`name` as the profiler writes it ("aten::mm"); an unknown name reads the dispatcher's table again (a library
    such as bitsandbytes registers its operators when it is imported)."""
    if name not in _known:
        if name.startswith("c10d::") or "::" not in name:
            _known[name] = False
        else:
            if name not in _kernels:
                _read_dispatcher()
            _known[name] = name in _kernels
    return _known[name]
