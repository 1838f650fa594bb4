"""The CPU tracker (counting allocator) against an independent method (the profiler's raw allocator events)."""

import pytest
import torch

from llmem.measure.counting import CountingTracker
from llmem.measure.cpu import CpuTracker
from llmem.measure.run import measure_rank
from llmem.plan import TrainingPlan
from tests.measure.conftest import GPT2, LLAMA, MIXTRAL


class Both:
    """Both trackers around the same run: the counting allocator inside the profiler's window."""

    def __init__(self):
        self.prof, self.count = CpuTracker(), CountingTracker()

    def __enter__(self):
        self.prof.__enter__()
        self.count.__enter__()
        return self

    def mark(self, name):
        self.prof.mark(name)

    def reset_peak(self):
        self.prof.reset_peak()
        self.count.reset_peak()

    def __exit__(self, *exc):
        self.count.__exit__(*exc)
        self.prof.__exit__(*exc)

    @property
    def peak_bytes(self):
        return self.count.peak_bytes

    @property
    def live_at_reset(self):
        return self.count.live_at_reset

    @property
    def end_bytes(self):
        return self.count.end_bytes


def test_known_allocations_counted_exactly():
    torch.set_num_threads(1)
    with CountingTracker() as t:
        a = torch.empty(1000, dtype=torch.float32)  # 4000 B
        t.reset_peak()
        b = torch.empty(500, dtype=torch.float64)  # 4000 B
        del b
        c = torch.empty(100, dtype=torch.bfloat16)  # 200 B
    assert t.live_at_reset == 4000
    assert t.peak_bytes == 8000
    assert t.end_bytes == 4200
    del a, c


@pytest.mark.parametrize("config,plan", [
    (LLAMA, dict(precision="fp32")),
    (LLAMA, dict(precision="bf16-mixed", optimizer_impl="foreach", grad_ckpt="full")),
    (GPT2, dict(precision="fp32", attn="eager")),  # LayerNorm: kernel scratch both must see
    (MIXTRAL, dict(precision="bf16", optimizer="sgd", optimizer_impl="fused")),
], ids=["llama-fp32", "llama-mixed-ckpt", "gpt2-eager", "mixtral-bf16-sgd"])
def test_counting_allocator_equals_profiler(config, plan):
    plan = TrainingPlan(device="cpu", batch_size=2, seq_len=32, **plan)
    both = Both()
    res = measure_rank(dict(config), plan, 2, tracker=both)
    assert both.prof.trace.peak_bytes == both.count.peak_bytes == res["peak_bytes"]
    assert both.prof.trace.live_at_reset == both.count.live_at_reset
    assert res["peak_bytes"] > res["live_at_reset"] > 0
    assert res["end_bytes"] == 0  # every counted allocation was freed again: no missed frees


def test_reset_keeps_what_is_live():
    """The peak after the reset starts from the live bytes (like reset_peak_memory_stats), not from zero."""
    plan = TrainingPlan(device="cpu", batch_size=1, seq_len=16, precision="fp32")
    res = measure_rank(dict(LLAMA), plan, 1)
    params = sum(p.numel() for p in __import__("llmem.runtime", fromlist=["x"]).build_model(LLAMA, plan).parameters())
    assert res["live_at_reset"] >= 4 * params
