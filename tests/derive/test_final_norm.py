"""The final norm's traced backward (`llmem.derive.final_norm`): the fake-tensor curve against the same norm run on
real CPU tensors in the allocation tracker, and the generated table against a fresh trace."""

import pytest
import torch

from llmem.components.final_norm_table import CURVES
from llmem.derive.final_norm import curve
from llmem.measure.cpu import CpuTracker

T, H = 384, 192  # a size the trace's fit points (tokens ≤ 24, h ≤ 80) never saw


def _real_rise(norm: torch.nn.Module, dtype: torch.dtype, mixed: bool) -> int:
    """Peak live bytes of the norm's backward on real tensors above its start, the output gradient made by a
    backward node (held by the engine alone), as in the trace."""
    x = torch.randn(1, T, H, dtype=dtype, requires_grad=True)
    with CpuTracker() as tracker:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
            z = norm(x) * 2.0
        seed = torch.ones_like(z)
        tracker.reset_peak()
        z.backward(seed)
    return tracker.peak_bytes - tracker.live_at_reset


def _traced(model_type: str, kind: str) -> int:
    return max(a * T * H + b * T + c * H + d for a, b, c, d in CURVES[(model_type, kind, False)])


@pytest.mark.parametrize("kind, dtype, mixed", [("fp32", torch.float32, False), ("half", torch.bfloat16, False),
                                                ("mixed", torch.float32, True)])
def test_the_rmsnorm_curve_is_what_the_real_backward_allocates(kind, dtype, mixed):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    real = _real_rise(LlamaRMSNorm(H).to(dtype), dtype, mixed)
    assert abs(real - _traced("llama", kind)) <= 64, (real, _traced("llama", kind))  # (the CPU allocator's rounding)


def test_the_layernorm_curve_is_what_the_real_backward_allocates():
    real = _real_rise(torch.nn.LayerNorm(H), torch.float32, False)
    assert abs(real - _traced("gpt2", "fp32")) <= 64, (real, _traced("gpt2", "fp32"))


def test_the_generated_table_is_a_fresh_trace():
    assert curve({"model_type": "llama"}, "half", frozen=True) == CURVES[("llama", "half", True)]


@pytest.mark.heavy
def test_every_entry_of_the_generated_table_is_a_fresh_trace():
    from pathlib import Path

    import llmem.components.final_norm_table as table
    from llmem.derive.final_norm import table_text

    assert table_text() == Path(table.__file__).read_text()
