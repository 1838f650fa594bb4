"""The worker's attempts rule: a multi-rank CPU row is measured MULTI_RANK_CPU_ATTEMPTS times and the attempt with
the lower peak kept; single-rank and CUDA rows once (the collectives are replaced by stand-ins here: one process)."""

from llmem.measure import worker
from llmem.runtime.topology import Topology


def _rank(peak: int) -> dict:
    return {"rank": 0, "peak_bytes": peak, "live_at_reset": 0, "end_bytes": 0, "seconds": 0.0}


def _run(monkeypatch, peaks: list, world: int, device: str = "cpu"):
    calls = iter(peaks)
    monkeypatch.setattr(worker, "run_row", lambda row, topo, dev: next(calls))
    monkeypatch.setattr(worker, "gather", lambda obj, topo: [obj] * topo.world_size)
    return worker.measure_row({"id": "r", "plan": {}}, Topology(rank=0, world_size=world, device_type=device), device)


def test_multi_rank_cpu_rows_keep_the_lower_attempt(monkeypatch):
    per_rank, peaks = _run(monkeypatch, [_rank(1000 + 92160), _rank(1000)], world=2)
    assert peaks == [1000 + 92160, 1000] and per_rank[0]["peak_bytes"] == 1000 and len(per_rank) == 2
    summary = worker.summarize({"id": "r", "plan": {}}, per_rank, "cpu", peaks)
    assert summary["peak_bytes"] == 1000 and summary["attempt_peaks"] == peaks


def test_single_rank_and_cuda_rows_are_measured_once(monkeypatch):
    assert _run(monkeypatch, [_rank(5)], world=1)[1] == [5]
    assert _run(monkeypatch, [_rank(7)], world=2, device="cuda")[1] == [7]


def test_an_error_stops_the_attempts(monkeypatch):
    per_rank, peaks = _run(monkeypatch, [{"rank": 0, "error": "OOM: x"}, _rank(1)], world=2)
    assert "error" in per_rank[0] and peaks == []
