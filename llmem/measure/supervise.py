"""Run a torchrun launch as a supervised child process.

torchrun is started in a process group of its own and waited on with a deadline. Whatever ends the wait — the
launch finishing, the deadline, an exception, Ctrl-C, or SIGTERM to this process (turned into `SystemExit` while a
launch runs) — nothing it started is left behind: torchrun is asked to stop its workers (SIGTERM to its group),
then anything still alive whose command line names the job file is killed (workers run in sessions of their own,
so a signal to torchrun's group does not reach them when torchrun itself cannot forward it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

STOP_GRACE_S = 5.0  # torchrun's own stop (SIGTERM to each worker, then reaping) before SIGKILL


@contextlib.contextmanager
def terminate_raises():
    """While inside, on the main thread: SIGTERM raises `SystemExit(143)` so that `finally` blocks stop the launch
    and remove its files. A second SIGTERM during that cleanup is ignored; the previous handler comes back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        signal.signal(signum, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def processes_naming(marker: str) -> list[int]:
    """Live processes (zombies excluded) with `marker` as one of their command-line arguments."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker.encode() in args and int(entry.name) != os.getpid():
            found.append(int(entry.name))
    return found


def _signal_group(pid: int, sig: int) -> None:
    for send in (os.killpg, os.kill):  # a worker leads its own group; fall back to the process alone
        with contextlib.suppress(ProcessLookupError, PermissionError):
            send(pid, sig)
            return


def kill_stragglers(marker: str, timeout: float = STOP_GRACE_S) -> list[int]:
    """SIGKILL every process naming `marker` (and its group); wait (bounded) until they are gone."""
    pids = processes_naming(marker)
    for pid in pids:
        _signal_group(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while processes_naming(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids


def stop(proc: subprocess.Popen, marker: str) -> None:
    """Stop torchrun and its workers: SIGTERM to torchrun's group (it stops its workers), SIGKILL after the grace
    period, then every leftover process naming `marker`."""
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(STOP_GRACE_S)
    kill_stragglers(marker)


def run_supervised(cmd: list[str], env: dict, job_dir: Path, marker: str, timeout: float,
                   cwd: str | None = None) -> int | None:
    """Run `cmd` with its stdout/stderr in `job_dir`/torchrun.out and torchrun.err. Returns its exit code (negative:
    killed by that signal), or None when it was stopped at `timeout` seconds. Wrap the caller in
    `terminate_raises()` for SIGTERM to stop it too."""
    with open(job_dir / "torchrun.out", "wb") as out, open(job_dir / "torchrun.err", "wb") as err:
        proc = None
        try:
            proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True)
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        finally:
            if proc is not None:
                stop(proc, marker)
            else:
                kill_stragglers(marker)
