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


def test_a_partial_rope_of_odd_width_still_traces_the_norm(caplog):
    """phi's partial_rotary_factor 0.4 on a one-head layer of h = 48 rotates 19 channels against cos/sin of 20:
    transformers' layer cannot run there, the trace failed (a fake-tensor error log on stderr) and the final norm's
    moment was dropped. Its curve is the real LayerNorm backward's."""
    import logging

    from tests.derive.configs import config

    with caplog.at_level(logging.ERROR, logger="torch._subclasses.fake_tensor"):
        events = curve(config("phi", partial_rotary_factor=0.4), "fp32")
    assert not [r for r in caplog.records if r.name.startswith("torch")]
    real = _real_rise(torch.nn.LayerNorm(H), torch.float32, False)
    assert abs(real - max(a * T * H + b * T + c * H + d for a, b, c, d in events)) <= 64
