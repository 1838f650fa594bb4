"""Run a measuring job: in this process for one rank, under torchrun for several (spawned from here), or in the
torchrun launch we are already part of (no second spawn; rank 0 gathers)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from llmem.runtime.topology import under_torchrun

JOB_TIMEOUT_S = int(os.environ.get("LLMEM_JOB_TIMEOUT", "3600"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(nproc: int) -> list[str]:
    exe = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    base = [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]
    return [*base, "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1", "--master_port",
            str(_free_port()), "-m", "llmem.measure.worker"]


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


def run_job(rows: list[dict], world_size: int, device: str, out_path: Path | None = None,
            timeout: float | None = None) -> tuple[list[dict], str]:
    """Measure `rows` (all of `world_size` ranks). Returns (results of the rows that finished, launch error)."""
    job = {"device": device, "rows": rows}
    if world_size == 1 and not under_torchrun():
        from llmem.measure import worker

        return worker.run_job(job, str(out_path) if out_path else None), ""
    if under_torchrun():
        from llmem.measure import worker

        if int(os.environ["WORLD_SIZE"]) != world_size:
            from llmem.errors import InputError

            raise InputError("gpus", f"this torchrun launch has {os.environ['WORLD_SIZE']} ranks, the plan needs "
                             f"{world_size}")
        return worker.run_job(job, str(out_path) if out_path else None), ""
    with tempfile.TemporaryDirectory(prefix="llmem-") as tmp:
        job_path = Path(tmp) / "job.json"
        job_path.write_text(json.dumps(job))
        out = out_path or Path(tmp) / "out.jsonl"
        before = len(read_jsonl(out))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        cmd = [*torchrun_command(world_size), str(job_path), str(out)]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout or JOB_TIMEOUT_S)
            err = "" if proc.returncode == 0 else _launch_error(proc.stderr, proc.returncode)
        except subprocess.TimeoutExpired:
            err = "timeout: the torchrun job did not finish"
        return read_jsonl(out)[before:], err


def _launch_error(stderr: str, code: int) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("USDT")]
    interesting = [ln for ln in lines if "Error" in ln or "error" in ln]
    tail = (interesting or lines or [""])[-1].strip()
    return f"torchrun exited with code {code}: {tail[:300]}"
