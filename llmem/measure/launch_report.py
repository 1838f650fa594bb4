"""What each rank of a failed or stopped torchrun launch did, in one line.

torchrun's failure summary gives each failed rank's exit code (negative: the signal that ended it); each rank's
own stderr is in the launch's log folder (`--log-dir ... --redirects 3`). A launch that failed before any rank
ran (no summary, no logs) is described by the last error line torchrun printed.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

_FAILURE = re.compile(r"^\s*rank\s*:\s*(\d+)\b[^\n]*\n\s*exitcode\s*:\s*(-?\d+)", re.MULTILINE)
TAIL_CHARS = 240


def rank_exits(torchrun_stderr: str) -> dict[int, int]:
    """rank -> exit code, from torchrun's failure summary. (Its "first observed failure" is left out: it compares
    whole seconds, so a rank that fails within the same second as the one that was killed can be shown first.)"""
    return {int(r): int(c) for r, c in _FAILURE.findall(torchrun_stderr)}


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = f" ({signal.Signals(-code).name})"
        except ValueError:
            name = ""
        return f"killed by signal {-code}{name}"
    return f"exit code {code}"


def _last_line(lines: list[str]) -> str:
    lines = [ln.strip() for ln in lines if ln.strip() and not ln.startswith("USDT")]
    errors = [ln for ln in lines if "Error" in ln or "error" in ln or "Killed" in ln]
    last = (errors or lines or [""])[-1]
    return last if len(last) <= TAIL_CHARS else last[:TAIL_CHARS] + "…"


def rank_stderr_tail(log_dir: Path, rank: int) -> str | None:
    """The last error line (else the last line) rank `rank` wrote to stderr, without torchrun's `[rankN]:`;
    None when the rank never started (no log)."""
    logs = sorted(log_dir.glob(f"*/attempt_*/{rank}/stderr.log"), key=lambda p: p.stat().st_mtime)
    if not logs:
        return None
    prefix = f"[rank{rank}]:"
    text = logs[-1].read_text(errors="replace")
    return _last_line([ln.removeprefix(prefix) for ln in text.splitlines()])


def launch_report(code: int | None, torchrun_stderr: str, log_dir: Path, world_size: int,
                  timeout: float) -> str:
    """One line: how the launch ended, then each rank's end and last stderr line. `code` None: timed out."""
    if code is None:
        head = f"timeout: the torchrun job did not finish within {timeout:.0f} s and was stopped"
    elif code < 0:
        head = f"torchrun was {describe_exit(code)}"
    else:
        head = f"torchrun exited with code {code}"
    exits = rank_exits(torchrun_stderr) if code else {}
    parts = []
    for rank in range(world_size):
        tail = rank_stderr_tail(log_dir, rank)
        if rank in exits:
            what = describe_exit(exits[rank])
        elif tail is None:
            continue  # never started
        elif code is None:
            what = "still running at the timeout"
        else:
            what = "exit code 0" if exits else "ended"
        parts.append(f"rank {rank} {what}" + (f": {tail}" if tail else ""))
    if not parts:
        parts.append(_last_line(torchrun_stderr.splitlines()) or "no rank started")
    return f"{head} — " + "; ".join(parts)
