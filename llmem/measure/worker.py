"""A measuring job: one or many rows (config + plan), run by every rank of one launch.

    torchrun --nproc_per_node N -m llmem.measure.worker JOB.json OUT.jsonl

JOB.json: {"device": "cpu"|"cuda", "rows": [{"id", "config", "plan", "steps"}, ...]}; every row needs the
launch's world size. Each row is isolated: an exception becomes that row's error and the job goes on. Rank 0
gathers every rank's figures and appends one JSON line per row to OUT.jsonl as soon as the row is done, so a
crash later in the job loses nothing already measured. Also runs without torchrun (one process).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback

from llmem.errors import InputError
from llmem.plan import TrainingPlan
from llmem.runtime.topology import Topology, under_torchrun

ROW_TIMEOUT_S = int(os.environ.get("LLMEM_COLLECTIVE_TIMEOUT", "300"))
# A multi-rank CPU row is measured twice and the lower peak kept. gloo's worker threads can only delay a free
# (gloo_fence.py fences the collectives known to matter), never advance one, so thread timing can raise a measured
# peak above the drop-point program's (the CUDA one) but not lower it: the minimum over attempts is the estimator
# of that program. Under full-suite load on 2 cores about one multi-rank row in 300 measured high once (a DDP LoRA
# row +90 KiB, a ZeRO-3 row +0.8 MiB) with nothing freed on gloo's threads to show for it.
MULTI_RANK_CPU_ATTEMPTS = 2


def versions() -> dict:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def init_distributed(device_type: str) -> Topology:
    topo = Topology.from_env(device_type)
    if topo.world_size > 1 or under_torchrun():
        import torch.distributed as dist

        if not dist.is_initialized():
            backend = "nccl" if device_type == "cuda" else "gloo"
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=ROW_TIMEOUT_S))
    return topo


def gather(obj, topo: Topology) -> list:
    if topo.world_size == 1:
        return [obj]
    import torch.distributed as dist

    out = [None] * topo.world_size
    dist.all_gather_object(out, obj)
    return out


def error_text(exc: BaseException) -> str:
    if isinstance(exc, InputError):
        return str(exc)
    name = type(exc).__name__
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if "out of memory" in str(exc).lower():
        return f"OOM: {first}"
    return f"{name}: {first}"


def run_row(row: dict, topo: Topology, device_type: str) -> dict:
    from llmem.measure.run import collect, measure_rank

    try:
        plan = TrainingPlan(**{**row["plan"], "device": device_type})
        res = measure_rank(row["config"], plan, int(row.get("steps", 2)), topo)
    except Exception as exc:  # one bad row must not stop the grid
        if os.environ.get("LLMEM_DEBUG"):
            traceback.print_exc()
        res = {"rank": topo.rank, "error": error_text(exc)}
    collect()
    return res


def _row_peak(per_rank: list[dict]) -> float:
    return max((r.get("peak_bytes", float("inf")) for r in per_rank), default=float("inf"))


def measure_row(row: dict, topo: Topology, device_type: str) -> tuple[list[dict], list[int]]:
    """Every rank's figures for `row` (each rank gets all of them, so all ranks decide alike), and the peak of
    each attempt (MULTI_RANK_CPU_ATTEMPTS)."""
    tries = MULTI_RANK_CPU_ATTEMPTS if topo.world_size > 1 and device_type == "cpu" else 1
    attempts = []
    for _ in range(tries):
        attempts.append(gather(run_row(row, topo, device_type), topo))
        if any("error" in r for r in attempts[-1]):
            break
    return min(attempts, key=_row_peak), [int(_row_peak(a)) for a in attempts if _row_peak(a) != float("inf")]


def summarize(row: dict, per_rank: list[dict], device_type: str, attempt_peaks: list[int] | None = None) -> dict:
    errors = [(r["rank"], r["error"]) for r in per_rank if "error" in r]
    out = {"id": row.get("id"), "device": device_type, "plan": row["plan"], "world_size": len(per_rank), **versions()}
    if errors:
        if len(errors) == len(per_rank) and len({e for _, e in errors}) == 1:
            out["error"] = errors[0][1]
        else:
            out["error"] = "; ".join(f"rank {r}: {e}" for r, e in errors)
        return out
    out["per_rank"] = [int(r["peak_bytes"]) for r in per_rank]
    out["peak_bytes"] = max(out["per_rank"])
    out["live_at_reset"] = [int(r["live_at_reset"]) for r in per_rank]
    if device_type == "cuda":
        out["reserved_bytes"] = [int(r["reserved_bytes"]) for r in per_rank]
    out["end_bytes"] = [int(r["end_bytes"]) for r in per_rank]
    if all("peak_bytes_with_scratch" in r for r in per_rank):  # CPU: kernel scratch included (max over ranks)
        out["peak_bytes_with_scratch"] = max(int(r["peak_bytes_with_scratch"]) for r in per_rank)
    if all("foreign_free_bytes" in r for r in per_rank):
        out["foreign_free_bytes"] = [int(r["foreign_free_bytes"]) for r in per_rank]
    out["seconds"] = round(max(r["seconds"] for r in per_rank), 3)
    if attempt_peaks and len(attempt_peaks) > 1:
        out["attempt_peaks"] = attempt_peaks
    return out


def run_job(job: dict, out_path: str | None) -> list[dict]:
    device_type = job.get("device", "cpu")
    topo = init_distributed(device_type)
    results = []
    for row in job["rows"]:
        per_rank, attempt_peaks = measure_row(row, topo, device_type)
        if topo.rank == 0:
            res = summarize(row, per_rank, device_type, attempt_peaks)
            results.append(res)
            if out_path:
                with open(out_path, "a") as fh:
                    fh.write(json.dumps(res) + "\n")
                    fh.flush()
    if topo.world_size > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (1, 2):
        print("usage: python -m llmem.measure.worker JOB.json [OUT.jsonl]", file=sys.stderr)
        return 2
    with open(argv[0]) as fh:
        job = json.load(fh)
    run_job(job, argv[1] if len(argv) == 2 else None)
    return 0


if __name__ == "__main__":
    code = main()
    # Every result is written and the process group destroyed; skip the interpreter's teardown, where C++ objects
    # of gloo / device meshes are destroyed in an order that now and then aborts the process ("terminate called
    # without an active exception") after all the work is done, which torchrun would report as a failed job.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
