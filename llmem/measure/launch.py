"""Run a measuring job: in this process for one rank (a DeepSpeed one: under torchrun), under torchrun for several
(spawned from here), or in the torchrun launch we are already part of (no second spawn; rank 0 gathers)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

from llmem.runtime.topology import under_torchrun

JOB_TIMEOUT_S = int(os.environ.get("LLMEM_JOB_TIMEOUT", "3600"))


def launcher_command(nproc: int, log_dir: Path) -> list[str]:
    """torchrun for `nproc` local ranks, up to (not including) what it runs. Its rendezvous store binds port 0
    itself (no port picked here and bound later: parallel launches cannot race for it); each rank's stdout and
    stderr go to `log_dir`/<run>/attempt_0/<rank>/."""
    exe = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    base = [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]
    return [*base, "--nnodes", "1", "--nproc_per_node", str(nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-id", f"llmem-{uuid.uuid4().hex[:12]}",
            "--local-addr", "127.0.0.1", "--log-dir", str(log_dir), "--redirects", "3"]


def torchrun_command(nproc: int, log_dir: Path) -> list[str]:
    return [*launcher_command(nproc, log_dir), "-m", "llmem.measure.worker"]


def run_launch(cmd: list[str], job_dir: Path, world_size: int, timeout: float, marker: str,
               env: dict | None = None, cwd: str | None = None) -> str:
    """Run a torchrun command (its ranks logging under `job_dir`/logs), bounded by `timeout` s and stopped with
    everything it started on any exit. Returns "" on success, else one line on what each rank did."""
    from llmem.measure.launch_report import launch_report
    from llmem.measure.supervise import run_supervised

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    code = run_supervised(cmd, env, job_dir, marker, timeout, cwd)
    if code == 0:
        return ""
    stderr = (job_dir / "torchrun.err").read_text(errors="replace")
    return launch_report(code, stderr, job_dir / "logs", world_size, timeout)


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line cut by a crash
    return rows


def _launched(row: dict) -> bool:
    """A DeepSpeed row runs as its own launcher runs it even on one rank (`deepspeed --num_gpus 1`: a process with
    RANK / LOCAL_RANK / WORLD_SIZE set and a process group of one): under torchrun, which does the same, so that
    DeepSpeed's process-wide state (its communication backend, the group) never stays in this process. FSDP1 on
    one GPU (`accelerate launch --num_processes 1`) likewise: its process group of one."""
    return row.get("plan", {}).get("engine") in ("deepspeed", "fsdp1")


def run_job(rows: list[dict], world_size: int, device: str, out_path: Path | None = None,
            timeout: float | None = None) -> tuple[list[dict], str]:
    """Measure `rows` (all of `world_size` ranks). Returns (results of the rows that finished, launch error)."""
    job = {"device": device, "rows": rows}
    if world_size == 1 and not under_torchrun():
        from llmem.measure import worker

        here = [r for r in rows if not _launched(r)]  # in this process; DeepSpeed's, FSDP1's under a launch of one
        results = worker.run_job({**job, "rows": here}, str(out_path) if out_path else None) if here else []
        if len(here) == len(rows):
            return results, ""
        launched, err = _launch({**job, "rows": [r for r in rows if _launched(r)]}, 1, out_path, timeout)
        return results + launched, err
    if under_torchrun():
        from llmem.measure import worker

        if int(os.environ["WORLD_SIZE"]) != world_size:
            from llmem.errors import InputError

            raise InputError("gpus", f"this torchrun launch has {os.environ['WORLD_SIZE']} ranks, the plan needs "
                             f"{world_size}")
        return worker.run_job(job, str(out_path) if out_path else None), ""
    return _launch(job, world_size, out_path, timeout)


def _launch(job: dict, world_size: int, out_path: Path | None, timeout: float | None) -> tuple[list[dict], str]:
    """`job` under a torchrun launch of `world_size` processes spawned from here."""
    from llmem.measure.supervise import terminate_raises

    with terminate_raises(), tempfile.TemporaryDirectory(prefix="llmem-") as tmp:
        job_path = Path(tmp) / "job.json"
        job_path.write_text(json.dumps(job))
        out = out_path or Path(tmp) / "out.jsonl"
        before = len(read_jsonl(out))
        cmd = [*torchrun_command(world_size, Path(tmp) / "logs"), str(job_path), str(out)]
        err = run_launch(cmd, Path(tmp), world_size, timeout or JOB_TIMEOUT_S, str(job_path))
        return read_jsonl(out)[before:], err
