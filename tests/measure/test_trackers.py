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
    assert both.prof.trace.with_scratch.peak_bytes == both.count.peak_bytes_with_scratch
    assert both.prof.trace.live_at_reset == both.count.live_at_reset
    # the same operators' scratch; the profiler places a few wrapped Python scalars (8 B each) inside the operator
    # that consumes them, the allocator's operator stack does not
    prof, count = both.prof.trace.scratch, both.count.scratch()
    big = {op for op, s in prof.items() if s[2] > 1024} | {op for op, s in count.items() if s["total"] > 1024}
    assert all(abs(prof.get(op, [0, 0, 0])[2] - count.get(op, {"total": 0})["total"]) <= 64 for op in big)
    assert res["peak_bytes"] > res["live_at_reset"] > 0
    assert res["end_bytes"] == 0  # every counted allocation was freed again: no missed frees


def test_reset_keeps_what_is_live():
    """The peak after the reset starts from the live bytes (like reset_peak_memory_stats), not from zero."""
    plan = TrainingPlan(device="cpu", batch_size=1, seq_len=16, precision="fp32")
    res = measure_rank(dict(LLAMA), plan, 1)
    params = sum(p.numel() for p in __import__("llmem.runtime", fromlist=["x"]).build_model(LLAMA, plan).parameters())
    assert res["live_at_reset"] >= 4 * params


def test_kernel_scratch_is_left_out_and_named():
    """LayerNorm backward's CPU kernel allocates partial sums for the weight and bias gradients and frees them before
    it returns: scratch. The program peak is what the tensors alone add up to (counted by hand from their shapes)."""
    torch.set_num_threads(1)
    with CountingTracker() as t:
        x = torch.randn(32, 128, requires_grad=True)  # 16,384 B
        ln = torch.nn.LayerNorm(128)  # weight, bias: 512 B each
        t.reset_peak()
        y = ln(x)  # output 16,384; mean, rstd 128 B each (saved)
        y.backward(torch.ones_like(y))  # ones 16,384; x.grad 16,384; weight/bias grads 512 each
        del y
    assert "aten::native_layer_norm_backward" in t.scratch()
    assert t.peak_bytes_with_scratch > t.peak_bytes
    live_at_reset = 16384 + 512 + 512
    assert t.live_at_reset == live_at_reset
    assert t.peak_bytes == live_at_reset + 16384 + 2 * 128 + 16384 + 16384 + 512 + 512


def test_temporaries_of_a_composite_are_counted():
    """`cross_entropy` is a composite (no CPU kernel of its own): its `log_softmax` output is freed before it returns,
    but the CUDA program makes the same temporary, so it counts — unlike a kernel's scratch."""
    torch.set_num_threads(1)
    with CountingTracker() as t, torch.no_grad():
        logits = torch.randn(64, 100)  # 25,600 B
        target = torch.randint(0, 100, (64,))  # 512 B
        t.reset_peak()
        loss = torch.nn.functional.cross_entropy(logits, target)  # log_softmax temporary 25,600 B
    assert "aten::cross_entropy_loss" not in t.scratch()
    assert t.peak_bytes >= 25600 + 512 + 25600
    del logits, target, loss


_ISA_SCRIPT = """
import json, torch
from llmem.measure.run import measure_rank
from llmem.plan import TrainingPlan
plan = TrainingPlan(device="cpu", batch_size=2, seq_len=32, precision="bf16-mixed", grad_ckpt="full",
                    optimizer_impl="forloop")
res = measure_rank(json.loads(%r), plan, 2)
print(json.dumps([torch.backends.cpu.get_cpu_capability(), res["peak_bytes"], res["peak_bytes_with_scratch"]]))
"""


def test_program_peak_is_the_same_whatever_kernels_the_cpu_selects():
    """The same bf16-mixed step with the CPU's best kernels and with oneDNN and ATen held to AVX2 (a CPU without
    AVX-512): the kernel scratch differs (bf16 gemm buffers), the program's peak must not."""
    import json
    import os
    import subprocess
    import sys

    out = []
    for env in ({}, {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}):
        proc = subprocess.run([sys.executable, "-c", _ISA_SCRIPT % json.dumps(LLAMA)], capture_output=True, text=True,
                              env={**os.environ, **env}, timeout=300, cwd=os.getcwd())
        assert proc.returncode == 0, proc.stderr[-2000:]
        out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    (_, best, _), (cap, avx2, _) = out
    assert cap in ("AVX2", "DEFAULT")
    assert best == avx2, out
