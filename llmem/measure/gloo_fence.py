"""Make FSDP2's frees on gloo happen where the training thread drops its reference, as they do on CUDA.

gloo runs a collective on a worker thread that keeps its own reference to the input and output tensors until its
loop drops the finished work — sometimes after `work.wait()` has already returned on the training thread. A buffer
FSDP2 releases right after its collective (the all-gather input, the reduce-scatter input) is then freed on gloo's
thread at a moment that varies from run to run, and the measured peak of ZeRO-2/ZeRO-3 rows varied by up to one
layer's gradients. On CUDA the caching allocator frees at the Python drop point (FSDP2 keeps explicit references
instead of `record_stream`), so the fence below only restores the CUDA semantics on CPU.

The fence: each synchronous collective gets fresh views of its tensors, and returns only once gloo has released
them: weak references to the views have died and each storage's reference count is back to what it was before the
views were made (`storage_uses`). No allocation is added: views share the storage.
The reduce-scatter is gloo's own algorithm written out (clone, all-reduce, copy out) so that its
clone can be fenced too. Asynchronous calls (`async_op=True`, unused by the runtime) pass through unchanged.
"""

from __future__ import annotations

import contextlib
import time
import weakref

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

RELEASE_TIMEOUT_S = 10.0


def storage_uses(*tensors) -> list:
    """Each distinct storage of `tensors` with its reference count, read before gloo is given views of them. A view
    gloo keeps holds the storage, so the count is back only once gloo has let go of every one: the Python views
    dying is not enough (under load a ZeRO-3 row's reduce-scatter clones were still freed on gloo's thread now and
    then after their views had died, +20,352 B on one rank's peak in about one measurement in fifteen)."""
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages.setdefault(storage._cdata, storage)
    del storage
    return [(s, torch._C._storage_Use_Count(s._cdata)) for s in storages.values()]


def _held(refs: list[weakref.ref], uses: list) -> bool:
    return any(r() is not None for r in refs) or any(torch._C._storage_Use_Count(s._cdata) > n for s, n in uses)


def wait_released(refs: list[weakref.ref], uses: list = (), timeout: float = RELEASE_TIMEOUT_S) -> None:
    """Wait until every referent is gone and every storage of `uses` (`storage_uses`) is back to its count; gloo
    drops its work within microseconds. The first checks only yield the GIL, then the wait backs off to 1 ms
    sleeps: on a machine whose cores are all busy, a spinning training thread would take CPU time from the gloo
    thread it waits for. Nothing is allocated meanwhile, so how long the wait lasts does not change the measurement."""
    deadline = time.monotonic() + timeout
    delay = 0.0
    while _held(refs, uses):
        if time.monotonic() > deadline:
            raise RuntimeError("gloo did not release a collective's tensors within "
                               f"{timeout:.0f} s; the measured peak would depend on thread timing")
        time.sleep(delay)
        delay = min(0.001, delay * 2 or 1e-6)


def all_reduce_in_place(buffer, op, group) -> None:
    """`dist.all_reduce(buffer)`, returning once gloo has released the view of `buffer` it was given."""
    uses = storage_uses(buffer)
    view = buffer.view(buffer.shape)
    refs = [weakref.ref(view)]
    work = dist.all_reduce(view, op=op, group=group, async_op=True)
    del view
    work.wait()
    del work
    wait_released(refs, uses)


class FencedAllGather(DefaultAllGather):
    """gloo's `all_gather_into_tensor` on CPU as ProcessGroupGloo::_allgather_base runs it — the output chunked
    into one view per rank, then `allgather` — with the chunks made here, so that all of them can be fenced."""

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        if async_op:
            return super().__call__(output_tensor, input_tensor, group, async_op=True)
        uses = storage_uses(output_tensor, input_tensor)
        chunks = list(output_tensor.chunk(group.size()))
        view = input_tensor.view(input_tensor.shape)
        refs = [weakref.ref(t) for t in (*chunks, view)]
        work = dist.all_gather(chunks, view, group=group, async_op=True)
        del chunks, view
        work.wait()
        del work
        wait_released(refs, uses)
        return None


class FencedReduceScatter(DefaultReduceScatter):
    """gloo's `reduce_scatter_tensor` on CPU, step for step (ProcessGroupGloo::reduce_scatter_tensor_coalesced):
    clone the input on the calling thread, all-reduce the clone, copy this rank's chunk out. The clone is freed
    once gloo has released it instead of whenever its worker thread drops the all-reduce."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        if async_op:
            return super().__call__(output_tensor, input_tensor, group, op, async_op=True)
        buffer = input_tensor.clone()
        all_reduce_in_place(buffer, op, group)
        output_tensor.copy_(buffer.chunk(group.size())[group.rank()])
        return None


def fenced_functional_all_reduce(original):
    """`torch.distributed._functional_collectives.all_reduce` as the functional op runs it (a contiguous clone,
    all-reduced in place), waited and fenced. Tensor parallelism's DTensor redistributions go through it."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.distributed_c10d import _resolve_process_group

    ops = {"sum": dist.ReduceOp.SUM, "product": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
           "max": dist.ReduceOp.MAX}

    def all_reduce(self, reduceOp: str, group, tag: str = ""):
        op = ops.get(reduceOp.lower())
        if op is None or self.is_complex():
            return original(self, reduceOp, group, tag)
        resolved = funcol._resolve_group(group, tag)
        pg = resolved if isinstance(resolved, dist.ProcessGroup) else _resolve_process_group(
            funcol._group_or_group_name(resolved))
        out = self.clone(memory_format=torch.contiguous_format)
        all_reduce_in_place(out, op, pg)
        return out

    return all_reduce


def fenced_functional_all_gather(original):
    """`torch.distributed._functional_collectives.all_gather_single` as the functional op runs it (an output of
    `world` times the input's rows, gathered into by gloo's `_allgather_base`: one chunk per rank), waited and
    fenced, then `_maybe_view_chunk_cat` for another gather dim as the original does. DTensor's Shard -> Replicate
    goes through it (transformers' `colwise_gather_output` lm_head under TP): unfenced, gloo's worker thread kept
    the gathered logits and their local shard alive into the loss now and then (+196,608 B on one rank of a bf16
    LoRA+TP row, docs/notes/2026-11-27-lora-tp.md)."""
    import torch.distributed._functional_collectives as funcol
    from torch._utils import _maybe_view_chunk_cat
    from torch.distributed.distributed_c10d import _resolve_process_group

    gather = dist.all_gather  # taken before `fenced` replaces it

    def all_gather_single(self, gather_dim: int, group, tag: str = ""):
        if not self.is_contiguous() or self.is_complex():
            return original(self, gather_dim, group, tag)
        resolved = funcol._resolve_group(group, tag)
        pg = resolved if isinstance(resolved, dist.ProcessGroup) else _resolve_process_group(
            funcol._group_or_group_name(resolved))
        world = pg.size()
        out = self.new_empty((world * self.shape[0], *self.shape[1:]))
        _gather_released(gather, out.chunk(world), self, pg)
        return _maybe_view_chunk_cat(out, world, gather_dim) if gather_dim != 0 else out

    return all_gather_single


def _gather_released(all_gather, outputs, tensor, group) -> None:
    """`all_gather(outputs, tensor)` through gloo on views of the caller's tensors, returning once gloo's worker
    thread has released them (`wait_released`): what the fenced all-gathers share."""
    uses = storage_uses(*outputs, tensor)
    chunks = [t.view(t.shape) for t in outputs]
    view = tensor.view(tensor.shape)
    refs = [weakref.ref(t) for t in (*chunks, view)]
    work = all_gather(chunks, view, group=group, async_op=True)
    del chunks, view
    work.wait()
    del work
    wait_released(refs, uses)


def fsdp1_collectives(all_gather, reduce_scatter_single):
    """FSDP1's two collectives on CPU, fenced: `FlatParamHandle._all_gather_flat_param` calls
    `dist.all_gather(chunks, shard)` on CPU tensors (gloo's allgather copies through a flat output it allocates on the
    calling thread), `_reduce_grad` calls `dist.reduce_scatter_single(shard, padded_grad)` (gloo: clone, all-reduce,
    copy out). Each returns once gloo has released its tensors, as `FencedAllGather` / `FencedReduceScatter` do."""

    def fenced_all_gather(tensor_list, tensor, group=None, async_op=False):
        if async_op:
            return all_gather(tensor_list, tensor, group=group, async_op=True)
        _gather_released(all_gather, tensor_list, tensor, group)
        return None

    def fenced_reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if async_op:
            return reduce_scatter_single(output, input, op=op, group=group, async_op=True)
        world = dist.get_world_size(group)
        buffer = input.clone()
        all_reduce_in_place(buffer, op, group)
        output.copy_(buffer.chunk(world)[dist.get_rank(group)])
        return None

    return fenced_all_gather, fenced_reduce_scatter_single


def fenced_reduction(collective):
    """`dist.all_reduce(tensor, ...)` or `dist.reduce(tensor, dst, ...)` called synchronously (DeepSpeed ZeRO-1/2's
    `allreduce_bucket`: the flattened slices of a gradient bucket), returning once gloo has released the view of
    `tensor` it was given."""

    def fenced(tensor, *args, async_op=False, **kwargs):
        if async_op:
            return collective(tensor, *args, async_op=True, **kwargs)
        uses = storage_uses(tensor)
        view = tensor.view(tensor.shape)
        refs = [weakref.ref(view)]
        work = collective(view, *args, async_op=True, **kwargs)
        del view
        work.wait()
        del work
        wait_released(refs, uses)
        return None

    return fenced


def fenced_all_gather_into_tensor(all_gather):
    """DeepSpeed's `all_gather_into_tensor` (ZeRO-1/2's step gathers the new flat partitions into the flat
    parameters, `runtime/utils.py: all_gather_into_tensor_dp_groups`), as `FencedAllGather` runs FSDP2's."""

    def fenced(output_tensor, input_tensor, group=None, async_op=False):
        world = dist.get_world_size(group)
        uses = storage_uses(output_tensor, input_tensor)
        chunks = list(output_tensor.chunk(world))
        view = input_tensor.view(input_tensor.shape)
        refs = [weakref.ref(t) for t in (*chunks, view)]
        work = all_gather(chunks, view, group=group, async_op=True)
        del chunks, view
        if async_op:
            return work
        work.wait()
        del work
        wait_released(refs, uses)
        return None

    return fenced


@contextlib.contextmanager
def _deepspeed_fenced(all_gather):
    """When DeepSpeed is in use: its all-gather, all-reduce and reduce. Its communication backend keeps the
    all-gather function it found at its start (`deepspeed/comm/torch.py: TorchBackend.get_all_gather_function`), so
    it is fenced there; the reductions it looks up in torch.distributed at each call."""
    import sys

    comm = sys.modules.get("deepspeed.comm.comm")
    cdb = getattr(comm, "cdb", None)
    if cdb is None or not hasattr(cdb, "all_gather_function"):
        yield
        return
    originals = cdb.all_gather_function, dist.all_reduce, dist.reduce
    cdb.all_gather_function = fenced_all_gather_into_tensor(all_gather)
    dist.all_reduce, dist.reduce = fenced_reduction(originals[1]), fenced_reduction(originals[2])
    try:
        yield
    finally:
        cdb.all_gather_function, dist.all_reduce, dist.reduce = originals


@contextlib.contextmanager
def fenced(model):
    """While inside: FSDP2 modules of `model` use the fenced collectives, and so do DTensor's all-reduces and
    all-gathers, FSDP1's all-gather and reduce-scatter (`fsdp1_collectives`), and DeepSpeed's reduce and all-gather
    (`_deepspeed_fenced`)."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(FencedAllGather())
            module.set_custom_reduce_scatter(FencedReduceScatter())
    original, original_gather = funcol.all_reduce, funcol.all_gather_single
    originals = dist.all_gather, dist.reduce_scatter_single
    funcol.all_reduce = fenced_functional_all_reduce(original)
    funcol.all_gather_single = fenced_functional_all_gather(original_gather)
    dist.all_gather, dist.reduce_scatter_single = fsdp1_collectives(*originals)
    try:
        with _deepspeed_fenced(originals[0]):
            yield
    finally:
        funcol.all_reduce, funcol.all_gather_single = original, original_gather
        dist.all_gather, dist.reduce_scatter_single = originals
