"""Record every storage allocation and free of a run under fake tensors, with its op, phase and module.

`AllocationTracker` is a `TorchDispatchMode` entered *inside* `FakeTensorMode`, so it sees each aten op before the
fake kernel runs and the (fake) outputs after. A new storage among the outputs is an allocation of its
`nbytes()`; a weak reference to the storage's Python object (storages keep their Python object alive as long
as the C++ storage lives) reports the free. Three ways of changing a storage's size bypass "new output storage":
  * `UntypedStorage.resize_` (FSDP2 frees and re-allocates unsharded parameters this way, outside dispatch):
    patched for the duration of the run;
  * in-place `aten.resize_` / `aten.set_` on an existing tensor: the storage's size is re-read after the op;
  * DTensor ops decompose into local-tensor ops, which the tracker sees like any other.
What it cannot see: memory a kernel allocates for itself and frees before returning (CPU LayerNorm backward,
bf16 matmul packing, cuBLAS workspaces). docs/SIMULATION.md lists the consequences.

Events are (op_index, block, delta) with delta > 0 for an allocation and < 0 for a free; a block is one
allocation's lifetime (a storage resized from 0 to n and back is a new block each time). `blocks[b]` says who
allocated it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_RESIZING = {_aten.resize_.default, _aten.resize_as_.default, _aten.set_.source_Storage,
             _aten.set_.source_Storage_storage_offset, _aten.set_.source_Tensor}


@dataclass(frozen=True)
class BlockInfo:
    """One allocation: its size and origin."""

    nbytes: int
    op: str  # the aten op (or "resize_", or a closed-form label)
    module: str  # the innermost module running when it was allocated ("" outside any module)
    phase: int  # index into the tracker's phase list
    shape: str = ""
    closed_form: bool = False
    stream: int = 0  # the stream current when it was allocated (0: the default stream; see _stream_index)


class AllocationTracker(TorchDispatchMode):
    """`with FakeTensorMode(), AllocationTracker() as t: ...`; then `t.events`, `t.blocks`, `t.phases`."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[int, int, int]] = []
        self.blocks: list[BlockInfo] = []
        self.phases: list[tuple[str, int, int, int]] = []  # (name, iteration, first op index, first event index)
        self.op_index = 0
        self.module = ""
        self._live: dict[int, tuple[int, int, object]] = {}  # storage key -> (block, nbytes, weakref)
        self._phase = -1
        self._iteration = 0
        self._orig_resize = None
        self.paused = 0  # > 0: ops run untracked (DTensor's sharding propagation builds throw-away fake args)
        self.host_scalars = False  # True: `.item()` gives a stand-in value (see __torch_dispatch__)
        self.scalar_answer = None  # not None: `.item()` gives this value (a value another rank sends: --pp's vote)
        self.stand_ins: dict = {}  # op -> stand-in(func, args, kwargs) run instead of the fake kernel (stand_ins.py)
        self.streams: list = [torch.cpu.current_stream()]  # stream objects seen, index = BlockInfo.stream
        self.device_type: str | None = None  # set: only its storages are the device's, the rest host (fake_cuda.py)
        self.host_live = self.host_peak = 0  # host bytes of a fake-CUDA run, live and largest since the reset
        self._host: dict[int, tuple[int, object]] = {}  # storage key -> (nbytes, weakref)

    # phases and modules ------------------------------------------------------------------------------------
    def mark(self, name: str) -> None:
        if name in ("forward", "pipeline"):  # an iteration starts (--pp: the schedule's step runs both passes)
            self._iteration += 1
        self.module = ""
        self.phases.append((name, self._iteration, self.op_index, len(self.events)))
        self._phase = len(self.phases) - 1

    def in_backward(self) -> bool:
        return self._phase >= 0 and self.phases[self._phase][0].startswith("backward")

    def reset_peak(self) -> None:
        self.host_peak = self.host_live
        self.phases.append(("reset", self._iteration, self.op_index, len(self.events)))
        self._phase = len(self.phases) - 1

    @property
    def reset_event(self) -> int:
        return next((ev for name, _, _, ev in self.phases if name == "reset"), 0)

    # allocations ----------------------------------------------------------------------------------------
    def add_block(self, nbytes: int, op: str, shape: str = "", closed_form: bool = False) -> int:
        """Record an allocation (also used for the closed-form buffers) and return its block number."""
        block = len(self.blocks)
        self.blocks.append(BlockInfo(nbytes, op, self.module, self._phase, shape, closed_form, self._stream_index()))
        self.events.append((self.op_index, block, nbytes))
        return block

    def _stream_index(self) -> int:
        """The current stream, as the caching allocator sees it (`malloc(device, size, stream)` takes
        `getCurrentCUDAStream()`). The fake run's tensors are CPU tensors, and FSDP2 picks its streams through
        `_get_device_handle(device.type)`, i.e. `torch.cpu.Stream` / `torch.cpu.stream(s)`, which set the stream
        `torch.cpu.current_stream()` returns: each distinct stream object is one CUDA stream of the real run."""
        current = torch.cpu.current_stream()
        for i, s in enumerate(self.streams):
            if s is current:
                return i
        self.streams.append(current)
        return len(self.streams) - 1

    def free_block(self, block: int) -> None:
        self.events.append((self.op_index, block, -self.blocks[block].nbytes))

    def _freed(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None and entry[1] and entry[0] >= 0:
            self.free_block(entry[0])

    def outside_allocator(self, storage) -> None:
        """Know `storage` without counting it (memory the caching allocator does not see: CUDA unified memory),
        so that ops returning it later do not count it either."""
        key = storage._cdata
        self._live[key] = (-1, storage.nbytes(), weakref.ref(storage, lambda _r, key=key: self._live.pop(key, None)))

    def _track_host(self, storage) -> None:
        """A host storage of a fake-CUDA run: on the host ledger, never an allocator block."""
        key = storage._cdata
        nbytes = storage.nbytes()
        entry = self._host.get(key)
        if entry is None:
            entry = (0, weakref.ref(storage, lambda _r, key=key: self._host_freed(key)))
        self.host_live += nbytes - entry[0]
        self.host_peak = max(self.host_peak, self.host_live)
        self._host[key] = (nbytes, entry[1])

    def _on_host(self, storage, tensor: torch.Tensor | None) -> bool:
        """A fake storage's own device is meta: its tensor's says where it lives (a resized one: where it was)."""
        if tensor is None:
            return storage._cdata in self._host
        return tensor.device.type != self.device_type

    def _host_freed(self, key: int) -> None:
        entry = self._host.pop(key, None)
        if entry is not None:
            self.host_live -= entry[0]

    def _track(self, storage, op: str, tensor: torch.Tensor | None) -> None:
        if self.device_type is not None and self._on_host(storage, tensor):
            self._track_host(storage)
            return
        key = storage._cdata
        nbytes = storage.nbytes()
        entry = self._live.get(key)
        if entry is not None:
            if entry[1] == nbytes or entry[0] < 0 < entry[1]:
                return
            # resized: the new block is allocated before the old one is released (copy then free)
            block = self.add_block(nbytes, op, _shape(tensor)) if nbytes else -1
            if entry[1]:
                self.free_block(entry[0])
            self._live[key] = (block, nbytes, entry[2])
            return
        block = self.add_block(nbytes, op, _shape(tensor)) if nbytes else -1
        ref = weakref.ref(storage, lambda _r, key=key: self._freed(key))
        self._live[key] = (block, nbytes, ref)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t not in _PLAIN and not issubclass(t, _FakeTensor) for t in types):
            return NotImplemented  # a wrapper subclass (DTensor): let it decompose into local-tensor ops
        if func is _aten._local_scalar_dense.default and self.scalar_answer is not None:
            return self.scalar_answer
        if func is _aten._local_scalar_dense.default and self.host_scalars:
            return _stand_in_scalar(args[0])
        stand_in = self.stand_ins.get(func)
        out = func(*args, **(kwargs or {})) if stand_in is None else stand_in(func, args, kwargs or {})
        if self.paused:
            return out
        self.op_index += 1
        name = None
        if func in _RESIZING and args and isinstance(args[0], torch.Tensor):
            self._track(args[0].untyped_storage(), func.__name__, args[0])
        if isinstance(out, torch.Tensor):
            name = func.__name__
            self._track_output(out, name)
        elif isinstance(out, (tuple, list)):
            name = func.__name__
            for t in out:
                if isinstance(t, torch.Tensor):
                    self._track_output(t, name)
                elif isinstance(t, (tuple, list)):
                    for u in t:
                        if isinstance(u, torch.Tensor):
                            self._track_output(u, name)
        return out

    def _track_output(self, t: torch.Tensor, name: str) -> None:
        """An op's output; a meta-device tensor has no memory in the real run either (DeepSpeed's ZeRO-1/2 keeps a
        `zeros_like(param, device="meta")` per parameter, `stage_1_and_2.py:413`)."""
        if t.device.type != "meta":
            self._track(t.untyped_storage(), name, t)

    def __enter__(self):
        tracker = self
        orig = torch.UntypedStorage.resize_
        self._orig_resize = orig

        def resize_(storage, size):
            result = orig(storage, size)
            tracker._track(storage, "UntypedStorage.resize_", None)
            return result

        torch.UntypedStorage.resize_ = resize_
        orig_rng = torch.get_rng_state
        self._orig_rng = orig_rng

        def get_rng_state():
            # a real CPU byte tensor made outside dispatch; activation checkpointing saves one per region
            state = orig_rng()
            tracker._track(state.untyped_storage(), "get_rng_state", state)
            return state

        torch.get_rng_state = get_rng_state
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        torch.get_rng_state = self._orig_rng
        return super().__exit__(*exc)

    def live_bytes(self) -> int:
        return sum(nbytes for _, nbytes, _ in self._live.values())


def _stand_in_scalar(t: torch.Tensor):
    """`.item()` of a fake tensor, where the run allows it (an optimizer step that reads step counts and norms on
    the host: torch's Adafactor, bitsandbytes' 8-bit optimizers): 1 of the tensor's kind. On the device it is a
    copy to the host and no allocation; the values only scale the update, never a tensor's size."""
    if t.dtype.is_floating_point:
        return 1.0
    return True if t.dtype is torch.bool else 1


def _shape(t: torch.Tensor | None) -> str:
    if t is None:
        return ""
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
