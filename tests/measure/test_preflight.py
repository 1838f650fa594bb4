"""Preflight: a CPU run predicted not to fit in the host memory available is refused with one line, exit 2,
before any worker starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from llmem.estimate import estimate
from llmem.measure import launch, preflight
from llmem.plan import TrainingPlan
from llmem.sources import resolve_model
from llmem.spec import ModelSpec
from tests.measure.test_validate_bad_input import refused, suite

GIB = 2**30
BIG = "llama-3.1-8b"


def meminfo_available() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemAvailable in /proc/meminfo")


@pytest.fixture
def machine_24gib(monkeypatch):
    monkeypatch.setattr(preflight, "available_bytes", lambda: 24 * GIB)
    monkeypatch.setattr(launch, "run_job", lambda *a, **k: pytest.fail("a run started"))


def test_an_8b_model_on_a_24_gib_machine_is_refused(machine_24gib, capsys):
    line = refused(capsys, "model", "measure", "--model", BIG, "--device", "cpu", "--seq-len", "512")
    assert "24.0 GiB is available" in line and "--seq-len" in line and "--device cuda" in line


def test_validate_names_the_row_that_cannot_fit(machine_24gib, capsys, tmp_path):
    path = suite(tmp_path, f"rows: [{{id: small, model: gpt2, seq_len: 64}}, {{id: eight-b, model: {BIG}}}]")
    line = refused(capsys, "suite", "validate", "--suite", path, "--device", "cpu", "--out", str(tmp_path / "o"))
    assert "'eight-b'" in line and "'small'" not in line
    assert not (tmp_path / "o").exists()


def test_every_rank_counts(monkeypatch):
    """Room for one rank's estimated peak and a half: one rank may run, two may not."""
    config = resolve_model("llama-3.2-1b-instruct").config
    one = TrainingPlan(device="cpu", seq_len=256)
    peak = estimate(ModelSpec.from_config(config), one).peak_bytes
    assert peak > 4 * preflight.RANK_OVERHEAD_BYTES  # the half peak of room covers the per-process overhead
    monkeypatch.setattr(preflight, "available_bytes", lambda: int(1.5 * peak))
    assert preflight.host_memory_problem(config, one) is None
    problem = preflight.host_memory_problem(config, TrainingPlan(device="cpu", seq_len=256, gpus=2))
    assert problem and "2 ranks" in problem
    monkeypatch.setenv("LLMEM_SKIP_MEMORY_CHECK", "1")
    assert preflight.host_memory_problem(config, TrainingPlan(device="cpu", seq_len=256, gpus=2)) is None


def test_cuda_plans_are_not_checked_against_host_memory(monkeypatch):
    monkeypatch.setattr(preflight, "available_bytes", lambda: 1)
    assert preflight.host_memory_problem(resolve_model(BIG).config, TrainingPlan(device="cuda")) is None


def test_on_this_machine(tmp_path):
    """The real MemAvailable, through the command line: refused at once when the estimate says it cannot fit."""
    need = estimate(ModelSpec.from_config(resolve_model(BIG).config), TrainingPlan(device="cpu")).peak_bytes
    if need <= meminfo_available():
        pytest.skip("this machine has room for an 8B CPU run")
    proc = subprocess.run([sys.executable, "-m", "llmem", "measure", "--model", BIG, "--device", "cpu"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "model: a CPU run of this plan needs" in lines[0], proc.stderr[-2000:]
