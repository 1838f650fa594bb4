"""The point program of reserved memory: the plan's program with `torch.cuda.empty_cache()` called after wrapping
(torchtune's `cleanup_before_training` empties the cache before the first step; a model built on the meta device or
the CPU leaves as little cached): the build's cached segments given back, each segment that holds a live tensor
(a parameter, a shard, a bucket) kept whole with its free blocks. Its request stream is the plan's
(`request_stream.program_requests`) with the build and the wrap replaced by a prefix that lays out the same
segments (`emptied_prefix`); the two iterations follow as they are. Replayed through the allocator model it
gives the estimate's reserved point figure where `reserved.point_replays` (`reserved.point_bytes`); `simulate` checks
it with the real runtime's events replayed through the same model with an `empty_cache()` at the peak reset
(`Simulation.reserved_emptied_bytes`).

Rules (c10/cuda/CUDACachingAllocator.cpp, torch 2.13, as llmem/allocator.py models them): `emptyCache` →
`release_cached_blocks` frees every cached block that is a whole segment (`release_block`); a segment with any live
block stays. In the flat replay (`allocator_replay.peak_reserved`) a segment of the same bytes is made by a request
of its size (`get_allocation_size` of a multiple of 2 MiB, >= 10 MiB or 20 MiB, is itself), and its blocks are laid
out again in address order by requesting each one in turn from the freed segment (best fit takes the one free
block, `should_split` hands out its start); the free blocks are then freed. A small-pool segment (2 MiB) is laid out
by its blocks alone.
"""

from __future__ import annotations

from llmem.allocator import K_SMALL_BUFFER, K_SMALL_SIZE, CachingAllocator
from llmem.components.request_events import Stream
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec


def point_reserved_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """`max_memory_reserved` of the point program of a plan `request_stream.replays` accepts, default segments; kept
    per plan. Its stream is written once per layout with named slots (as `request_stream.replayed_reserved_bytes`)."""
    return spec.memo(("point_reserved", plan.key), lambda: _point(spec, plan), per_plan=True)


def _point(spec: ModelSpec, plan: TrainingPlan) -> int:
    from llmem.components import request_stream as rs

    sizes = rs._PlanSizes(spec, plan)
    columns, marks = rs.layout_stream(spec, plan, sizes)  # the high end's stream, written once per layout
    start = next(i for name, i in marks if name == "forward 1")
    events = spec.memo(("point_skeleton", columns), lambda: without_build(columns, start), per_plan=True)
    slots = sizes.slots()
    # the high end's key: a stream whose build frees nothing is its own point program, replayed once for both
    return spec.memo(("replayed_stream", events, tuple(slots.items()), False),
                     lambda: rs._replay_slots(events, slots, False), per_plan=True)


def without_build(columns: tuple, start: int) -> tuple:
    """The layout's stream (`Requests.columns`: keys, sizes, streams) with what comes before the first iteration
    (index `start`) replaced by `emptied_prefix`; `columns` itself when the prefix frees nothing."""
    keys, sizes, streams = columns
    if all(nbytes.__class__ is str or nbytes > 0 for nbytes in sizes[:start]):  # nothing freed, nothing to give
        return columns  # back: every segment of the prefix holds a live tensor (one GPU, DDP, untied embeddings)
    prefix = emptied_prefix(list(zip(keys[:start], sizes[:start], streams[:start], strict=True)))
    k, n, st = (tuple(c) for c in zip(*prefix, strict=True)) if prefix else ((), (), ())
    return Stream((k + keys[start:], n + sizes[start:], st + streams[start:]))


def emptied_prefix(prefix: list) -> tuple:
    """Events that leave the flat replay with the segments (and the live blocks, under their keys) that `prefix`
    leaves after `empty_cache()`."""
    alloc = CachingAllocator()
    live: dict = {}
    for key, nbytes, stream in prefix:
        if nbytes > 0:
            live[key] = alloc.malloc(nbytes, stream)
        else:
            alloc.free(live.pop(key, None))
    alloc.empty_cache()
    keys = {id(b): k for k, b in live.items()}
    firsts = {}
    for b in live.values():
        while b.prev is not None:
            b = b.prev
        firsts[b.addr] = b
    out: list = []
    gaps: list = []
    for addr in sorted(firsts):
        _lay_out(firsts[addr], keys, out, gaps)
    return tuple(out + [(g, -1, 0) for g in gaps])


def _lay_out(first, keys: dict, out: list, gaps: list) -> None:
    """One kept segment: (large pool) a request of its bytes, freed; then each block in address order, a free
    block under a key of its own (in `gaps`, freed after every segment is laid out; in a small-pool segment in
    pieces of at most 1 MiB, which stay in that pool)."""
    blocks = []
    b = first
    while b is not None:
        blocks.append(b)
        b = b.next
    total, stream = sum(x.size for x in blocks), first.stream
    small = total == K_SMALL_BUFFER  # a large-pool segment is 20 MiB or >= 10 MiB
    if not small:
        whole = ("segment", first.addr)
        out += [(whole, total, stream), (whole, -1, stream)]
    for x in blocks:
        if x.allocated:
            out.append((keys[id(x)], x.size, stream))
            continue
        step = K_SMALL_SIZE if small else x.size
        for at in range(x.addr, x.addr + x.size, step):
            gaps.append(("gap", at))
            out.append((("gap", at), min(step, x.addr + x.size - at), stream))
