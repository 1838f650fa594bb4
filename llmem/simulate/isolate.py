"""Run a fake-accelerator simulation (`fake_cuda.py`) in a process of its own.

The autograd engine makes its per-device worker queues once per process, at the first backward
(`torch/csrc/autograd/engine.cpp`: `start_device_threads`, one queue per device of each backend registered then):
a backward on `simgpu` in a process that ran a backward before the backend was registered fails its internal
assert (`device.index() < device_ready_queues_.size()`). Registering the backend is also for the life of the
process (`torch.accelerator` then reports it). So each such simulation runs in a fresh spawned process that
registers the backend before anything else, sends back the `Simulation` (or the error) and the progress lines, and
leaves with `os._exit` (the engine's device thread would abort the interpreter's shutdown, see fake_cuda.py).
"""

from __future__ import annotations

import multiprocessing
import os

_IN_CHILD = [False]


def in_child() -> bool:
    """True inside the spawned process: the simulation runs here."""
    return _IN_CHILD[0]


def _child(conn, config: dict, plan, rank, steps: int, with_progress: bool) -> None:
    _IN_CHILD[0] = True
    try:
        from llmem.simulate.fake_cuda import ensure_backend
        from llmem.simulate.run import simulate

        ensure_backend()
        progress = (lambda text: conn.send(("progress", text))) if with_progress else None
        conn.send(("result", simulate(config, plan, rank=rank, steps=steps, progress=progress)))
    except BaseException as exc:  # noqa: BLE001 - every error goes back to the caller, who raises it
        conn.send(("error", exc))
    finally:
        conn.close()
        os._exit(0)


def simulate_in_child(config: dict, plan, rank, steps: int, progress):
    """`simulate(config, plan, rank, steps)` in a fresh process; its progress lines passed on as they come."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, config, plan, rank, steps, progress is not None), daemon=True)
    proc.start()
    child.close()
    try:
        while True:
            try:
                kind, value = parent.recv()
            except EOFError:
                raise RuntimeError(f"the simulation process ended without an answer (exit code {proc.exitcode})") \
                    from None
            if kind == "progress":
                progress(value)
            elif kind == "error":
                raise value
            else:
                return value
    finally:
        proc.join()
