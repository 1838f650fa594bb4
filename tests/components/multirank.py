"""Shared harness of the multi-process test modules: named plan rows measured in one torchrun launch (gloo, CPU) of
the base plan's `gpus` processes (2 unless it says), cached per module (and, under pytest-xdist, shared by the
workers of one run: `shared_launch`), and one row's estimate checked against the measured max-over-ranks peak."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest

from llmem.estimate import estimate
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec

TOLERANCE = 0.03  # the multi-rank bar
# A harness that names no sample measures its first row by default: a multi-rank launch costs ~10-20 s of CPU on
# top of its rows, the suite has a 12-minute budget, and tests/accuracy measures every scheme x option of the suite
# by default. `-m heavy` measures every row.
DEFAULT_ROWS = 1


def heavy_selected() -> bool:
    """Whether this run selects `heavy` tests (`-m heavy`, or a marker expression without `not heavy`)."""
    import os
    return os.environ.get("LLMEM_HEAVY_RUN") == "1"


class TwoRankRows:
    """`sampled`: the rows the default run measures in one launch (default: the first `DEFAULT_ROWS`); the others
    are `heavy` (`params` gives that parametrization) or, in a test parametrized otherwise, skipped by default and
    measured in a launch of their own under `-m heavy`."""

    def __init__(self, base: dict, rows: dict[str, dict], config_of: Callable[[str], dict],
                 sampled: Iterable[str] | None = None) -> None:
        self.base, self.rows, self.config_of = base, rows, config_of
        self.sampled = set(list(rows)[:DEFAULT_ROWS] if sampled is None else sampled)
        self._results: dict = {}
        self._launched: set[bool] = set()

    def params(self) -> list:
        return [n if n in self.sampled else pytest.param(n, marks=pytest.mark.heavy) for n in self.rows]

    def plan(self, name: str) -> TrainingPlan:
        return TrainingPlan(**{**self.base, **self.rows[name], "device": "cpu"})

    def measured(self, name: str | None = None) -> dict:
        """The rows measured so far, after the launch of `name`'s part (sampled or not; default: the sampled)."""
        part = name is None or name in self.sampled
        if not part and not heavy_selected():
            pytest.skip("measured under -m heavy (the default run measures the rows its harness samples)")
        if part not in self._launched:
            from llmem.measure.launch import run_job

            rows = [{"id": n, "config": self.config_of(n), "plan": {**self.base, **self.rows[n]}, "steps": 2}
                    for n in self.rows if (n in self.sampled) == part]
            gpus = int(self.base.get("gpus", 2))
            results, err = shared_launch(rows, gpus, lambda: run_job(rows, gpus, "cpu", timeout=900))
            if not results:
                pytest.fail(f"the {gpus}-process launch measured nothing: {err}")
            self._results.update({r["id"]: r for r in results})
            self._launched.add(part)
        return self._results

    def remeasure(self, name: str) -> dict:
        """`name` alone in a launch of its own. gloo's threads can delay a free but never advance one (see
        llmem/measure/worker.py), so a multi-rank CPU peak read high once is read again and the lower one kept:
        the minimum over launches estimates the program's peak, as the minimum over attempts within one does."""
        from llmem.measure.launch import run_job

        row = {"id": name, "config": self.config_of(name), "plan": {**self.base, **self.rows[name]}, "steps": 2}
        results, err = run_job([row], int(self.base.get("gpus", 2)), "cpu", timeout=900)
        again = next((r for r in results if "peak_bytes" in r), None)
        if again is not None and again["peak_bytes"] < self._results[name]["peak_bytes"]:
            self._results[name] = {**again, "launch_peaks": [self._results[name]["peak_bytes"], again["peak_bytes"]]}
        return self._results[name]

    def check(self, name: str, tolerance: float = TOLERANCE) -> None:
        res = self.measured(name)[name]  # (first: a row not measured by default skips before its estimate)
        est = estimate(ModelSpec.from_config(self.config_of(name)), self.plan(name)).peak_bytes
        assert "error" not in res, res.get("error")
        if est < res["peak_bytes"] * (1 - tolerance):  # read high: once more, in a launch of its own
            res = self.remeasure(name)
        error = (est - res["peak_bytes"]) / res["peak_bytes"]
        print(f"{name}: estimate {est:,} measured {res['peak_bytes']:,} ({error:+.3%})")  # shown by -rA
        assert abs(est - res["peak_bytes"]) <= tolerance * res["peak_bytes"], (
            f"{name}: estimate {est:,} not within {tolerance:.0%} of the measured {res['peak_bytes']:,}"
            f" (launches: {res.get('launch_peaks', [res['peak_bytes']])})")


def shared_launch(rows: list[dict], gpus: int, launch: Callable[[], tuple[list, str]]) -> tuple[list, str]:
    """`launch()` once per test run for these rows: under pytest-xdist (`PYTEST_XDIST_TESTRUNUID`, one id per run)
    the first worker launches under a file lock and stores the results, another worker asking for the same rows
    (a module's tests split across workers, or tests/simulate reusing a module's rows) waits and reads them."""
    import hashlib
    import json
    import os
    import tempfile
    from pathlib import Path

    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if uid is None:
        return launch()
    from filelock import FileLock

    key = hashlib.sha256(json.dumps([rows, gpus], sort_keys=True).encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / f"llmem-rows-{uid}"
    folder.mkdir(exist_ok=True)
    path = folder / f"{key}.json"
    with FileLock(str(path) + ".lock"):
        if path.exists():
            stored = json.loads(path.read_text())
            return stored["results"], stored["err"]
        results, err = launch()
        if results:
            path.write_text(json.dumps({"results": results, "err": err}))
        return results, err


def run_module_on_two_ranks(module: str, out) -> list[dict]:
    """`torchrun` 2 processes of `python -m module OUT` (a test module's own worker); each rank writes OUT.<rank>
    as JSON. Returns the ranks' results. Bounded, and on failure says what each rank did."""
    import json
    import tempfile
    from pathlib import Path

    from llmem.measure.launch import launcher_command, run_launch

    root = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory(prefix="llmem-test-") as tmp:
        cmd = [*launcher_command(2, Path(tmp) / "logs"), "-m", module, str(out)]
        err = run_launch(cmd, Path(tmp), 2, timeout=600, marker=str(out), env={"PYTHONPATH": str(root)},
                         cwd=str(root))
    assert err == "", err
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
