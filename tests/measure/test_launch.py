"""Multi-rank launches: a failed rank is named with what ended it, a launch is bounded in time, and stopping the
parent (SIGTERM, Ctrl-C) leaves no process and no job folder behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from llmem.measure.launch import run_job, run_launch
from llmem.measure.supervise import STOP_GRACE_S
from tests.measure.conftest import LLAMA
from tests.measure.procs import alive, cmdline, descendants, kill_tree, wait_for_workers, wait_gone

ROOT = Path(__file__).resolve().parents[2]
# Busy for far longer than any test waits: the tests end it themselves.
ENDLESS = {"id": "endless", "config": LLAMA, "plan": {"seq_len": 16, "precision": "fp32", "gpus": 2},
           "steps": 10**6}


def run_in_thread(rows, timeout: float) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def target():
        t0 = time.monotonic()
        box["results"], box["err"] = run_job(rows, 2, "cpu", timeout=timeout)
        box["seconds"] = time.monotonic() - t0

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


def test_a_killed_rank_is_named_with_its_signal():
    thread, box = run_in_thread([ENDLESS], timeout=600)
    try:
        workers = wait_for_workers(os.getpid(), 2)
        everything = descendants(os.getpid())
        os.kill(workers[1], signal.SIGKILL)
        thread.join(60)
    finally:
        kill_tree(os.getpid())
    assert not thread.is_alive(), "run_job did not return within 60 s of a rank's death"
    err = box["err"]
    assert "rank 1 killed by signal 9 (SIGKILL)" in err, err
    assert "rank 0 " in err, err  # the survivor is accounted for too (stopped by torchrun)
    assert box["results"] == []
    assert wait_gone(everything, 5) == []


STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", sys.argv[1]], start_new_session=True)
print(child.pid, flush=True)
time.sleep(600)
"""


def test_a_launch_past_its_timeout_is_stopped_with_what_it_started(tmp_path):
    """A launcher that ignores SIGTERM, with a child in a session of its own (as torchrun starts its workers):
    both are gone when the call returns, soon after the timeout."""
    marker = str(tmp_path / "job.json")
    t0 = time.monotonic()
    err = run_launch([sys.executable, "-c", STUBBORN, marker], tmp_path, 2, timeout=3, marker=marker)
    seconds = time.monotonic() - t0
    assert err.startswith("timeout:") and "within 3 s" in err, err
    assert "rank 0 still running" not in err  # no rank ever logged: not invented
    assert seconds < 3 + 2 * STOP_GRACE_S + 5, seconds
    child = int((tmp_path / "torchrun.out").read_text().split()[0])
    assert not alive(child)
    assert descendants(os.getpid()) == []


def test_a_launcher_failing_before_any_rank_is_reported_by_its_last_line(tmp_path):
    marker = str(tmp_path / "never-a-job.json")
    cmd = [sys.executable, "-c", "import sys; print('noise'); sys.exit('rendezvous failed: no store')", marker]
    err = run_launch(cmd, tmp_path, 2, timeout=60, marker=marker)
    assert err.startswith("torchrun exited with code 1"), err
    assert err.endswith("rendezvous failed: no store"), err


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGINT, 130)])
def test_stopping_measure_leaves_no_process_and_no_job_folder(tmp_path, sig, code):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA))
    cmd = [sys.executable, "-m", "llmem", "measure", "--model", str(cfg), "--device", "cpu", "--gpus", "2",
           "--seq-len", "16", "--precision", "fp32", "--steps", str(ENDLESS["steps"])]
    # SIGINT back to its default in the child, as at a terminal: a test run started in the background of a
    # non-interactive shell inherits SIGINT ignored, and Python then never raises KeyboardInterrupt
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        workers = wait_for_workers(proc.pid, 2)
        tree = descendants(proc.pid)
        args = cmdline(workers[0])
        job_dir = Path(args[args.index("llmem.measure.worker") + 1]).parent
        assert job_dir.is_dir()
        proc.send_signal(sig)
        t0 = time.monotonic()
        _, stderr = proc.communicate(timeout=30)
        stopped_after = time.monotonic() - t0
    finally:
        kill_tree(proc.pid)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == code, stderr[-2000:]
    assert stopped_after < 10, f"the parent took {stopped_after:.1f} s to stop"
    assert [p for p in tree if alive(p)] == [], [cmdline(p) for p in tree if alive(p)]
    assert not job_dir.exists()
    assert "Traceback" not in stderr, stderr[-2000:]
