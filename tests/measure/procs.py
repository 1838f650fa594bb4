"""Process-tree helpers of the launch tests, read straight from /proc (independent of llmem's own)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def alive(pid: int) -> bool:
    """Running (a zombie only waits for its parent to reap it: it holds no memory and runs nothing)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def descendants(root: int) -> list[int]:
    parents = {int(p.name): _parent(int(p.name)) for p in Path("/proc").glob("[0-9]*")}
    found, frontier = [], [root]
    while frontier:
        kids = [pid for pid, ppid in parents.items() if ppid in frontier and alive(pid)]
        found += kids
        frontier = kids
    return found


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(e.split(b"=", 1)[1]) for e in env if e.startswith(b"RANK=")]
    return ranks[0] if ranks else None


def wait_for_workers(root: int, n: int, timeout: float = 180.0) -> dict[int, int]:
    """rank -> pid of the `n` measuring workers below `root`, once all have started."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # torchrun names the worker module too; only the workers have a RANK
        workers = {rank_of(p): p for p in descendants(root) if "llmem.measure.worker" in cmdline(p)}
        workers.pop(None, None)
        if len(workers) == n:
            return workers
        time.sleep(0.2)
    raise AssertionError(f"{n} workers did not start below pid {root} within {timeout:.0f} s")


def wait_gone(pids, timeout: float) -> list[int]:
    """The pids of `pids` still running after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def kill_tree(root: int) -> None:
    """SIGKILL whatever `root` started that still runs (a failed test must not leave a launch behind)."""
    for pid in descendants(root):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
