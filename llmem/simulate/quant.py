"""QLoRA's bitsandbytes parameters under fake tensors (bitsandbytes 0.50, `bitsandbytes/nn/modules.py`).

`Params4bit` / `Int8Params` are `nn.Parameter` subclasses made with `Tensor._make_subclass(cls, data)`, which
refuses a fake tensor (it is already a `FakeTensor` subclass object). While simulating, a `Params4bit` (or
`Int8Params`) of fake data is the fake parameter itself, re-classed to a class deriving from both `FakeTensor` and
the bitsandbytes class: fake kernels (`FakeTensor.__torch_dispatch__`) with bitsandbytes' own Python methods
(`.to()` quantizes with `bnb.functional.quantize_4bit`, `__torch_function__` keeps the class through FSDP2's
`chunk`), and its attributes (`quant_state`, `blocksize`, …) set as its constructor sets them. Nothing is
allocated by the re-classing: the fake parameter aliases the data, as `_make_subclass` does. The quantization and
matmul kernels are bitsandbytes' registered fake implementations (`bitsandbytes/_ops.py`: `quantize_4bit`,
`dequantize_4bit`, `dequantize_blockwise`, `int8_vectorwise_quant`, …), which allocate the outputs the real
kernels return (packed uint8 codes, fp32 absmax, the dequantized weight in the compute dtype).
"""

from __future__ import annotations

import contextlib

_CLASSES: dict[type, type] = {}


def _fake_class(bnb_class: type) -> type:
    from torch._subclasses.fake_tensor import FakeTensor

    if bnb_class not in _CLASSES:
        _CLASSES[bnb_class] = type(f"Fake{bnb_class.__name__}", (FakeTensor, bnb_class), {})
    return _CLASSES[bnb_class]


def _fake_new(bnb_class: type, orig_new, attrs, grad_default: bool):
    """`bnb_class.__new__` that re-classes a fake tensor instead of calling `_make_subclass`; `attrs(kwargs)`
    gives the attributes the real constructor sets."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    def new(cls, data=None, requires_grad=grad_default, **kwargs):
        if data is None:
            data = torch.empty(0)
        if not isinstance(data, FakeTensor):
            return orig_new(cls, data, requires_grad, **kwargs)
        self = torch.nn.Parameter(data, requires_grad=requires_grad)
        self.__class__ = _fake_class(bnb_class)
        for name, value in attrs(kwargs).items():
            setattr(self, name, value)
        return self

    return new


def _params4bit_attrs(kw: dict) -> dict:
    """`Params4bit.__new__`'s attributes and defaults."""
    import torch

    return {"blocksize": kw.get("blocksize") or 64, "compress_statistics": kw.get("compress_statistics", True),
            "quant_type": kw.get("quant_type", "fp4"), "quant_state": kw.get("quant_state"),
            "quant_storage": kw.get("quant_storage", torch.uint8), "bnb_quantized": kw.get("bnb_quantized", False),
            "module": kw.get("module")}


def _int8params_attrs(kw: dict) -> dict:
    """`Int8Params.__new__`'s attributes and defaults."""
    return {"CB": kw.get("CB"), "SCB": kw.get("SCB"), "has_fp16_weights": kw.get("has_fp16_weights", False)}


@contextlib.contextmanager
def fake_bnb_params(plan):
    """Active for `--method qlora` only."""
    if str(plan.method) != "qlora":
        yield
        return
    import bitsandbytes as bnb

    classes = ((bnb.nn.Params4bit, _params4bit_attrs, False), (bnb.nn.Int8Params, _int8params_attrs, True))
    saved = [(cls, cls.__new__) for cls, _, _ in classes]
    for cls, attrs, grad_default in classes:
        cls.__new__ = _fake_new(cls, cls.__new__, attrs, grad_default)
    try:
        yield
    finally:
        for cls, orig in saved:
            cls.__new__ = orig
