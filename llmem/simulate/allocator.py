"""A model of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp, torch 2.13), to replay an
allocation sequence and predict `max_memory_allocated`, `max_memory_reserved` and the fragmentation at the peak.

Rules modelled (names as in the C++ source; docs/SIMULATION.md has the full list with line-level notes):
  round_size        requests are rounded up to a multiple of kMinBlockSize = 512 B (at least 512 B);
                    `roundup_power2_divisions` is off by default and not modelled.
  get_pool          rounded size <= kSmallSize (1 MiB): small pool, else large pool; pools never share blocks.
  get_free_block    best fit: the smallest cached free block of the pool with size >= request (ties: lowest
                    address, `BlockComparatorSize`). With max_split_size set: a request below it never takes a
                    block >= max_split_size, and a request >= it only takes a block < request + kLargeBuffer.
  get_allocation_size  no block found: a new segment (cudaMalloc) of kSmallBuffer = 2 MiB for small requests,
                    kLargeBuffer = 20 MiB for requests below kMinLargeAlloc = 10 MiB, else the request rounded up
                    to kRoundLarge = 2 MiB.
  should_split      small pool: split when the remainder >= 512 B; large pool: when the request is below
                    max_split_size and the remainder > kSmallSize (1 MiB); otherwise the whole block is handed
                    out and counted as allocated (`allocated_bytes` adds `block->size`).
  free_block        a freed block merges with free neighbours of its segment (`try_merge_blocks`); segments
                    are kept (never cudaFree'd) unless an allocation fails.
  OOM path          with a device capacity: release_available_cached_blocks (oversize blocks, only with
                    max_split_size), then release_cached_blocks (every unsplit cached segment) and retry.
  expandable_segments  one segment per pool that grows by mapping pages (2 MiB small pool, 20 MiB large pool)
                    at its end (`map_block`); blocks split whenever the remainder >= 512 B; a free block that
                    ends at the unmapped tail counts, for best fit, as its size plus the tail
                    (`expandable_size`); reserved = mapped pages.
Single stream, no CUDA graphs, no `record_stream`: the training step of DESIGN.md runs on the default stream.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

K_MIN_BLOCK = 512
K_SMALL_SIZE = 1 << 20
K_SMALL_BUFFER = 2 << 20
K_LARGE_BUFFER = 20 << 20
K_MIN_LARGE_ALLOC = 10 << 20
K_ROUND_LARGE = 2 << 20
NO_LIMIT = 1 << 62
_ADDRESS_SPACE = 1 << 48  # the virtual range reserved for one expandable segment


def round_size(size: int) -> int:
    if size < K_MIN_BLOCK:
        return K_MIN_BLOCK
    return K_MIN_BLOCK * ((size + K_MIN_BLOCK - 1) // K_MIN_BLOCK)


def allocation_size(size: int) -> int:
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


class _Block:
    __slots__ = ("addr", "size", "allocated", "prev", "next", "segment", "mapped")

    def __init__(self, addr: int, size: int, segment: int, mapped: bool = True) -> None:
        self.addr, self.size, self.segment, self.mapped = addr, size, segment, mapped
        self.allocated = False
        self.prev: _Block | None = None
        self.next: _Block | None = None


class _Pool:
    """Free (cached) blocks of one pool, ordered by (size, address) like `BlockComparatorSize`."""

    def __init__(self, small: bool) -> None:
        self.small = small
        self.keys: list[tuple[int, int]] = []
        self.blocks: dict[tuple[int, int], _Block] = {}

    def insert(self, b: _Block) -> None:
        key = (b.size, b.addr)
        bisect.insort(self.keys, key)
        self.blocks[key] = b

    def remove(self, b: _Block) -> None:
        key = (b.size, b.addr)
        i = bisect.bisect_left(self.keys, key)
        del self.keys[i]
        del self.blocks[key]

    def lower_bound(self, size: int) -> int:
        return bisect.bisect_left(self.keys, (size, -1))


@dataclass(frozen=True)
class AllocatorStats:
    """What the replay predicts (bytes). `*_at_peak` are taken when allocated memory peaks after the reset."""

    max_allocated: int  # max_memory_allocated: rounded block sizes
    max_reserved: int  # max_memory_reserved
    allocated_at_peak: int
    reserved_at_peak: int
    segments: int  # segments (cudaMalloc calls or mapped pages) live at the end
    device_mallocs: int
    ooms: int  # allocations that needed cached segments released first (capacity given)

    @property
    def fragmentation_at_peak(self) -> int:
        """Reserved but not allocated when allocated memory peaks."""
        return self.reserved_at_peak - self.allocated_at_peak

    def to_dict(self) -> dict:
        return {"max_allocated": self.max_allocated, "max_reserved": self.max_reserved,
                "allocated_at_peak": self.allocated_at_peak, "reserved_at_peak": self.reserved_at_peak,
                "fragmentation_at_peak": self.fragmentation_at_peak, "segments": self.segments,
                "device_mallocs": self.device_mallocs, "ooms": self.ooms}


class CachingAllocator:
    """`malloc(size) -> handle`, `free(handle)`; statistics like torch.cuda's (`reset_peak()` included)."""

    def __init__(self, expandable_segments: bool = False, max_split_size: int | None = None,
                 capacity: int | None = None) -> None:
        self.expandable = expandable_segments
        self.max_split = max_split_size or NO_LIMIT
        self.capacity = capacity or NO_LIMIT
        self.pools = {True: _Pool(True), False: _Pool(False)}
        self.allocated = self.reserved = 0
        self.peak_allocated = self.peak_reserved = 0
        self.device_mallocs = self.ooms = 0
        self._next_addr = 0
        self._segments: dict[int, int] = {}  # live segment id -> bytes reserved
        self._segment_small: dict[int, bool] = {}
        self._seg_counter = 0
        self._tails: dict[bool, _Block | None] = {True: None, False: None}  # expandable: unmapped tail per pool

    # statistics -----------------------------------------------------------------------------------------
    def reset_peak(self) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def _grow(self, n: int) -> None:
        self.reserved += n
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    # malloc / free --------------------------------------------------------------------------------------
    def malloc(self, nbytes: int) -> _Block | None:
        if nbytes <= 0:
            return None
        size = round_size(nbytes)
        small = size <= K_SMALL_SIZE
        pool = self.pools[small]
        block = self._get_free_block(pool, size)
        if block is None:
            block = self._alloc_block(pool, size)
            if block is None:
                self.ooms += 1
                self._release_cached_blocks()
                block = self._alloc_block(pool, size)
                if block is None:  # out of memory even after emptying the cache: go over capacity
                    cap, self.capacity = self.capacity, NO_LIMIT
                    block = self._alloc_block(pool, size)
                    self.capacity = cap
        else:
            pool.remove(block)
        if self._should_split(block, size, small):
            rest = _Block(block.addr + size, block.size - size, block.segment, block.mapped)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            pool.insert(rest)
        block.allocated = True
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, block: _Block | None) -> None:
        if block is None:
            return
        pool = self.pools[self._is_small(block)]
        block.allocated = False
        self.allocated -= block.size
        for other in (block.prev, block.next):
            if other is not None and not other.allocated and other.mapped:
                pool.remove(other)
                if other is block.prev:
                    block.addr = other.addr
                    block.prev = other.prev
                    if other.prev is not None:
                        other.prev.next = block
                else:
                    block.next = other.next
                    if other.next is not None:
                        other.next.prev = block
                block.size += other.size
        pool.insert(block)

    # internals --------------------------------------------------------------------------------------------
    def _is_small(self, block: _Block) -> bool:
        return self._segment_small[block.segment]

    def _should_split(self, block: _Block, size: int, small: bool) -> bool:
        remaining = block.size - size
        if small or self.expandable:
            return remaining >= K_MIN_BLOCK
        return size < self.max_split and remaining > K_SMALL_SIZE

    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        i = pool.lower_bound(size)
        if i >= len(pool.keys):
            return None
        block = pool.blocks[pool.keys[i]]
        if self.expandable:
            # best fit by the size a block can grow to: one that ends at the unmapped tail comes last
            def expandable_size(b: _Block) -> int:
                return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)

            j = i + 1
            while j < len(pool.keys) and expandable_size(pool.blocks[pool.keys[j]]) < expandable_size(block):
                block = pool.blocks[pool.keys[j]]
                j += 1
            return block
        if size < self.max_split <= block.size:
            return None
        if size >= self.max_split and block.size >= size + K_LARGE_BUFFER:
            return None
        return block

    def _alloc_block(self, pool: _Pool, size: int) -> _Block | None:
        if self.expandable:
            return self._alloc_expandable(pool, size)
        alloc = allocation_size(size)
        if self.reserved + alloc > self.capacity:
            return None
        seg = self._seg_counter
        self._seg_counter += 1
        block = _Block(self._next_addr, alloc, seg)
        self._next_addr += alloc
        self._segments[seg] = alloc
        self._segment_small[seg] = pool.small
        self.device_mallocs += 1
        self._grow(alloc)
        return block

    def _alloc_expandable(self, pool: _Pool, size: int) -> _Block | None:
        page = K_SMALL_BUFFER if pool.small else K_LARGE_BUFFER
        tail = self._tails[pool.small]
        if tail is None:  # a new segment: one virtual range, nothing mapped yet
            seg = self._seg_counter
            self._seg_counter += 1
            tail = _Block(self._next_addr, _ADDRESS_SPACE, seg, mapped=False)
            self._next_addr += _ADDRESS_SPACE
            self._segments[seg] = 0
            self._segment_small[seg] = pool.small
            self._tails[pool.small] = tail
        before = tail.prev if tail.prev is not None and not tail.prev.allocated else None
        have = before.size if before is not None else 0
        need = size - have
        mapped = page * ((need + page - 1) // page)
        if self.reserved + mapped > self.capacity:
            return None
        self.device_mallocs += 1
        self._segments[tail.segment] += mapped
        self._grow(mapped)
        if before is not None:
            pool.remove(before)
            before.size += mapped
            block = before
        else:
            block = _Block(tail.addr, mapped, tail.segment)
            block.prev = tail.prev
            if tail.prev is not None:
                tail.prev.next = block
        block.next = tail
        tail.prev = block
        tail.addr += mapped
        tail.size -= mapped
        return block

    def _release_cached_blocks(self) -> None:
        """`release_cached_blocks`: every cached segment that is one free block goes back to the device."""
        for pool in self.pools.values():
            for key in list(pool.keys):
                b = pool.blocks[key]
                if self.expandable:
                    continue  # unmapping free pages of an expandable segment: not modelled (rare)
                if b.prev is None and b.next is None:
                    pool.remove(b)
                    self.reserved -= b.size
                    self._segments.pop(b.segment, None)

    def stats(self) -> tuple[int, int]:
        return self.allocated, self.reserved

    @property
    def segment_count(self) -> int:
        return len(self._segments)


def replay(events: list[tuple[int, int, int]], reset_index: int = 0, expandable_segments: bool = False,
           max_split_size: int | None = None, capacity: int | None = None) -> AllocatorStats:
    """Replay (op, block, delta) events; the peak statistics are reset before event `reset_index`."""
    alloc = CachingAllocator(expandable_segments, max_split_size, capacity)
    handles: dict[int, _Block | None] = {}
    at_peak = (0, 0)
    best = -1
    for i, (_, block, delta) in enumerate(events):
        if i == reset_index:
            alloc.reset_peak()
            at_peak, best = (alloc.allocated, alloc.reserved), alloc.allocated
        if delta > 0:
            handles[block] = alloc.malloc(delta)
        else:
            alloc.free(handles.pop(block, None))
        if i >= reset_index and alloc.allocated > best:
            best = alloc.allocated
            at_peak = (alloc.allocated, alloc.reserved)
    if reset_index >= len(events):
        alloc.reset_peak()
        at_peak = (alloc.allocated, alloc.reserved)
    return AllocatorStats(alloc.peak_allocated, alloc.peak_reserved, at_peak[0], at_peak[1], alloc.segment_count,
                          alloc.device_mallocs, alloc.ooms)
