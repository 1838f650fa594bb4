"""Shape-preserving stand-ins for kernels whose fake (meta) implementation refuses what the real program runs. Each
allocates exactly the output the real kernel allocates (same shape, dtype and strides) and nothing else; the
tracker calls it instead of the op while simulating (`AllocationTracker.stand_ins`), below autograd, so the
backward graph is the real one. docs/SIMULATION.md lists them."""

from __future__ import annotations

import torch

_aten = torch.ops.aten


def grouped_mm(func, args, kwargs):
    """`aten._grouped_mm` (transformers' grouped MoE experts, `integrations/moe.py: _grouped_mm`, and its autograd
    backward): the meta function checks CUDA's BF16-only rule, yet the CPU kernel the measurement runs takes fp32
    and the CUDA program is the same grouped matmul. The output is the meta function's own
    (`torch/_meta_registrations.py: _create_grouped_mm_output_tensor`, torch 2.13): (tokens × top_k, out_dim)
    for the 2-D × 3-D case, in the input's dtype."""
    from torch._meta_registrations import _create_grouped_mm_output_tensor

    names = ("mat_a", "mat_b", "offs", "bias", "out_dtype")
    bound = {**dict(zip(names, args, strict=False)), **kwargs}
    return _create_grouped_mm_output_tensor(bound["mat_a"], bound["mat_b"], bound.get("offs"),
                                            bound.get("out_dtype"))


def fused_sgd(func, args, kwargs):
    """`aten._fused_sgd_` (`SGD(fused=True)`, torch/optim/sgd.py: `_fused_sgd`) has no fake kernel; FakeTensorMode
    would fall back to running the real CPU kernel on zero-filled real copies of every parameter, gradient and
    momentum buffer (the whole model in host memory). The kernel updates them in place and returns nothing; the
    momentum buffers of the first step are made in Python before it (`torch.empty_like`), and counted there."""
    return None


def wait_tensor(func, args, kwargs):
    """`_c10d_functional.wait_tensor` (DTensor's redistributions under TP: `funcol.wait_tensor` after each
    functional collective) returns its input, the collective's output, in the real program (the C++ kernel waits
    on the work and hands the tensor back); the fake kernel makes a new tensor, a second copy of the output."""
    return args[0]


def tied_accumulation(tied_shapes: set, in_backward) -> callable:
    """`aten.add.Tensor` as the autograd engine's `InputBuffer` sums the two gradients of a tied weight (torch 2.13
    `torch/csrc/autograd/input_buffer.cpp: accumulate`): `old_var.add_(var)` in place when grad mode is off and the
    gradient waiting in the buffer is a plain, non-overlapping dense tensor it holds the only reference to
    (`can_accumulate_inplace`), else `old_var + var`. Under a dispatch mode every tensor counts as a subclass
    (`at::isTensorSubclassLike`), so the fake run would always sum out of place; this stand-in takes the real
    decision where it depends on the program: in place unless the waiting gradient is a view (the lm_head's weight
    gradient is `.t()` of its matmul's outside autocast, a fresh `ToCopyBackward0` output under it). Only adds of a
    tied weight's shape during backward; any other add runs as before."""

    def add(func, args, kwargs):
        old, new = (args + (None, None))[:2]
        if (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and not kwargs and len(args) == 2
                and not torch.is_grad_enabled() and in_backward() and tuple(old.shape) in tied_shapes
                and old.shape == new.shape and old.dtype == new.dtype and not old._is_view()
                and old.is_contiguous()):
            return old.add_(new)
        return func(*args, **kwargs)

    return add


def stand_ins() -> dict:
    """op -> stand-in(func, args, kwargs) for every run."""
    return {_aten._grouped_mm.default: grouped_mm, _aten._fused_sgd_.default: fused_sgd,
            _aten._fused_sgd_.tensor_lr: fused_sgd,
            torch.ops._c10d_functional.wait_tensor.default: wait_tensor}
