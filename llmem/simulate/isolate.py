"""Run a fake-accelerator simulation (`fake_cuda.py`) in a process of its own.

The autograd engine makes its per-device worker queues once per process, at the first backward
(`torch/csrc/autograd/engine.cpp`: `start_device_threads`, one queue per device of each backend registered then):
a backward on `simgpu` in a process that ran a backward before the backend was registered fails its internal
assert (`device.index() < device_ready_queues_.size()`). Registering the backend is also for the life of the
process (`torch.accelerator` then reports it). So each such simulation runs in a fresh Python process (started with
`python -c`, so a caller's script is never re-imported, as `multiprocessing`'s spawn would) that registers the
backend before anything else, sends back the `Simulation` (or the error) and the progress lines over a pipe, and
leaves with `os._exit` (the engine's device thread would abort the interpreter's shutdown, see fake_cuda.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from multiprocessing.connection import Connection

_IN_CHILD = [False]
_BOOT = ("import sys\nfrom multiprocessing.connection import Connection\n"
         "down = Connection(int(sys.argv[1]), writable=False)\nup = Connection(int(sys.argv[2]), readable=False)\n"
         "sys.path[:0] = down.recv()\nfrom llmem.simulate.isolate import serve\nserve(down, up)\n")


def in_child() -> bool:
    """True inside the simulation's own process."""
    return _IN_CHILD[0]


def serve(down: Connection, up: Connection) -> None:
    """The child's side: one request `(config, plan, rank, steps, with_progress)` on `down`, its answers on `up`."""
    _IN_CHILD[0] = True
    try:
        from llmem.simulate.fake_cuda import ensure_backend
        from llmem.simulate.run import simulate

        ensure_backend()
        config, plan, rank, steps, with_progress = down.recv()
        progress = (lambda text: up.send(("progress", text))) if with_progress else None
        up.send(("result", simulate(config, plan, rank=rank, steps=steps, progress=progress)))
    except BaseException as exc:  # noqa: BLE001 - every error goes back to the caller, who raises it
        up.send(("error", exc))
    finally:
        up.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def simulate_in_child(config: dict, plan, rank, steps: int, progress):
    """`simulate(config, plan, rank, steps)` in a fresh process; its progress lines passed on as they come."""
    down_r, down_w = os.pipe()
    up_r, up_w = os.pipe()
    child = subprocess.Popen([sys.executable, "-c", _BOOT, str(down_r), str(up_w)], pass_fds=(down_r, up_w),
                             stdout=sys.stderr)
    os.close(down_r)
    os.close(up_w)
    to_child, from_child = Connection(down_w, readable=False), Connection(up_r, writable=False)
    try:
        to_child.send([p for p in sys.path if p])
        to_child.send((config, plan, rank, steps, progress is not None))
        while True:
            try:
                kind, value = from_child.recv()
            except EOFError:
                raise RuntimeError(f"the simulation process ended without an answer (exit code {child.wait()})") \
                    from None
            if kind == "progress":
                progress(value)
            elif kind == "error":
                raise value
            else:
                return value
    finally:
        to_child.close()
        from_child.close()
        child.wait()
