"""A model of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp, torch 2.13,
`DeviceCachingAllocator`), to replay an allocation sequence and predict `max_memory_allocated`,
`max_memory_reserved` and the fragmentation at the peak. Imports no torch: `simulate` replays a fake run's
allocations through it, and the estimate its own request stream (`llmem.components.request_stream`).

Rules modelled (names as in the C++ source; docs/SIMULATION.md has the table, tests/test_allocator.py one
test per rule):
  round_size        requests are rounded up to a multiple of kMinBlockSize = 512 B (at least 512 B); with
                    `roundup_power2_divisions` N (off by default) a request above 512·N B is rounded up to the
                    next of N equal divisions of its power-of-two interval (`roundup_power2_next_division`).
  get_pool          rounded size <= kSmallSize (1 MiB): small pool, else large pool; pools never share blocks.
  streams           every block belongs to the stream it was allocated on (`Block::stream`); the pools are
                    ordered by (stream, size, address) (`BlockComparatorSize`) and `get_free_block` only takes
                    a block of the requesting stream, so a block freed on one stream is never reused by another.
  get_free_block    best fit: the smallest cached free block of the pool and stream with size >= request (ties:
                    lowest address). With max_split_size set: a request below it never takes a block >= it, and
                    a request >= it only takes a block < request + kLargeBuffer.
  get_allocation_size  no block found: a new segment (cudaMalloc) of kSmallBuffer = 2 MiB for small requests,
                    kLargeBuffer = 20 MiB for requests below kMinLargeAlloc = 10 MiB, else the request rounded up
                    to kRoundLarge = 2 MiB.
  should_split      small pool or expandable segments: split when the remainder >= 512 B; large pool: when the
                    request is below max_split_size and the remainder > kSmallSize (1 MiB); otherwise the whole
                    block is handed out and counted as allocated (`alloc_found_block` adds `block->size`).
  free_block        a freed block merges with free, mapped neighbours of its segment (`try_merge_blocks`);
                    segments are kept (never cudaFree'd) unless an allocation fails or the cache is emptied.
  failure path      with a capacity (or a memory fraction): `garbage_collect_cached_blocks` first when
                    `garbage_collection_threshold` and a fraction are set, then `alloc_block`, then
                    `release_available_cached_blocks` (oversize blocks, only with max_split_size), then
                    `release_cached_blocks` (every unsplit cached segment); llmem/allocator_release.py.
  expandable_segments  one segment per pool and stream that grows by mapping pages (2 MiB small pool, 20 MiB
                    large pool) at its end (`try_allocate_expandable_block`, `map_block`); a free block that ends
                    at the unmapped tail counts, for best fit, as its size plus the tail (`expandable_size`);
                    reserved = mapped pages.
Not modelled: CUDA graphs' private pools, `record_stream` (its events delay a free until the other stream's
work is done: no program llmem runs calls it), IPC.
"""

from __future__ import annotations

import bisect

from llmem.allocator_release import ReleaseMixin

K_MIN_BLOCK = 512
K_SMALL_SIZE = 1 << 20
K_SMALL_BUFFER = 2 << 20
K_LARGE_BUFFER = 20 << 20
K_MIN_LARGE_ALLOC = 10 << 20
K_ROUND_LARGE = 2 << 20
NO_LIMIT = 1 << 62
_ADDRESS_SPACE = 1 << 48  # the virtual range reserved for one expandable segment


def round_size(size: int, divisions: int = 0) -> int:
    """`DeviceCachingAllocator::round_size` (with `roundup_power2_divisions` = `divisions` for every size)."""
    if size < K_MIN_BLOCK:
        return K_MIN_BLOCK
    if divisions > 1 and size > K_MIN_BLOCK * divisions:
        return _roundup_power2_next_division(size, divisions)
    return K_MIN_BLOCK * ((size + K_MIN_BLOCK - 1) // K_MIN_BLOCK)


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    low = size & ~(step - 1)
    return size if low == size else low + step


def allocation_size(size: int) -> int:
    """`get_allocation_size`: the bytes of a new segment for a (rounded) request."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


class _Block:
    __slots__ = ("addr", "size", "allocated", "prev", "next", "segment", "mapped", "stream", "gc_base")

    def __init__(self, addr: int, size: int, segment: int, stream: int = 0, mapped: bool = True) -> None:
        self.addr, self.size, self.segment, self.mapped, self.stream = addr, size, segment, mapped, stream
        self.allocated = False
        self.gc_base = 0
        self.prev: _Block | None = None
        self.next: _Block | None = None

    @property
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class _Pool:
    """Free (cached) blocks of one pool and stream, ordered by (size, address) like `BlockComparatorSize`."""

    def __init__(self, small: bool, calls: list[int]) -> None:
        self.small = small
        self.keys: list[tuple[int, int]] = []
        self.blocks: dict[tuple[int, int], _Block] = {}
        self.calls = calls  # `get_free_blocks_call_count`, one counter per BlockPool (shared by its streams)

    def insert(self, b: _Block) -> None:
        key = (b.size, b.addr)
        bisect.insort(self.keys, key)
        self.blocks[key] = b
        b.gc_base = self.calls[0]  # `insert_into_blocks`

    def remove(self, b: _Block) -> None:
        key = (b.size, b.addr)
        del self.keys[bisect.bisect_left(self.keys, key)]
        del self.blocks[key]

    def lower_bound(self, size: int) -> int:
        return bisect.bisect_left(self.keys, (size, -1))


class CachingAllocator(ReleaseMixin):
    """`malloc(size, stream=0) -> handle`, `free(handle)`, `empty_cache()`, `reset_peak()`; statistics like
    torch.cuda's. `capacity`: the device bytes cudaMalloc may hand out (default unlimited); `memory_fraction`
    (`set_per_process_memory_fraction`) caps reserved memory at that share of it and enables
    `garbage_collection_threshold`."""

    def __init__(self, expandable_segments: bool = False, max_split_size: int | None = None,
                 capacity: int | None = None, garbage_collection_threshold: float = 0.0,
                 memory_fraction: float | None = None, roundup_power2_divisions: int = 0) -> None:
        self.expandable = expandable_segments
        self.max_split = max_split_size or NO_LIMIT
        self.capacity = capacity or NO_LIMIT
        self.allowed = NO_LIMIT if memory_fraction is None else int(memory_fraction * self.capacity)
        self.gc_threshold = garbage_collection_threshold if memory_fraction is not None else 0.0
        self.divisions = roundup_power2_divisions
        self.pools: dict[tuple[int, bool], _Pool] = {}
        self._calls = {True: [0], False: [0]}
        self.allocated = self.reserved = 0
        self.peak_allocated = self.peak_reserved = 0
        self.device_mallocs = self.ooms = 0
        self._next_addr = 0
        self._segments: dict[int, int] = {}  # live segment id -> bytes reserved
        self._segment_small: dict[int, bool] = {}
        self._segment_base: dict[int, int] = {}  # expandable segments: first address (pages count from it)
        self._seg_counter = 0
        self._tails: dict[tuple[int, bool], _Block] = {}  # expandable: unmapped tail per (stream, pool)

    # statistics -----------------------------------------------------------------------------------------
    def reset_peak(self) -> None:
        """`resetPeakStats`: every peak becomes the current value."""
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def _grow(self, n: int) -> None:
        self.reserved += n
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _pool(self, stream: int, small: bool) -> _Pool:
        pool = self.pools.get((stream, small))
        if pool is None:
            pool = self.pools[(stream, small)] = _Pool(small, self._calls[small])
        return pool

    # malloc / free --------------------------------------------------------------------------------------
    def malloc(self, nbytes: int, stream: int = 0) -> _Block | None:
        """`DeviceCachingAllocator::malloc` on `stream`."""
        if nbytes <= 0:
            return None
        size = round_size(nbytes, self.divisions)
        small = size <= K_SMALL_SIZE
        pool = self._pool(stream, small)
        block = self._get_free_block(pool, size)
        if block is None:
            block = self._new_block(pool, size, stream)
        else:
            pool.remove(block)
        if self._should_split(block, size, small):
            rest = _Block(block.addr + size, block.size - size, block.segment, stream, block.mapped)
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
        """`free` → `free_block`: back to its stream's pool, merged with free neighbours."""
        if block is None:
            return
        pool = self._pool(block.stream, self._segment_small[block.segment])
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
    def _should_split(self, block: _Block, size: int, small: bool) -> bool:
        remaining = block.size - size
        if small or self.expandable:
            return remaining >= K_MIN_BLOCK
        return size < self.max_split and remaining > K_SMALL_SIZE

    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        if self.gc_threshold > 0:
            pool.calls[0] += 1
        i = pool.lower_bound(size)
        if i >= len(pool.keys):
            return None
        block = pool.blocks[pool.keys[i]]
        if self.expandable:
            # best fit by the size a block can grow to: one that ends at the unmapped tail comes later
            def expandable_size(b: _Block) -> int:
                return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)

            j = i + 1
            while j < len(pool.keys) and expandable_size(pool.blocks[pool.keys[j]]) < expandable_size(block):
                block = pool.blocks[pool.keys[j]]
                j += 1
        if size < self.max_split <= block.size:
            return None
        if size >= self.max_split and block.size >= size + K_LARGE_BUFFER:
            return None
        return block

    def _new_block(self, pool: _Pool, size: int, stream: int) -> _Block:
        """malloc's failure path: garbage collection, alloc_block, release_available_cached_blocks,
        release_cached_blocks; past that a real run raises OutOfMemoryError, the model goes over capacity."""
        if self.gc_threshold > 0:
            self.garbage_collect_cached_blocks()
        block = self._alloc_block(pool, size, stream)
        if block is None and self.release_available_cached_blocks(pool, size):
            block = self._alloc_block(pool, size, stream)
        if block is None:
            self.ooms += 1
            self.release_cached_blocks()
            block = self._alloc_block(pool, size, stream)
        if block is None:
            cap, allowed = self.capacity, self.allowed
            self.capacity = self.allowed = NO_LIMIT
            block = self._alloc_block(pool, size, stream)
            self.capacity, self.allowed = cap, allowed
        return block

    def _fits(self, nbytes: int) -> bool:
        return self.reserved + nbytes <= min(self.capacity, self.allowed)

    def _alloc_block(self, pool: _Pool, size: int, stream: int) -> _Block | None:
        if self.expandable:
            return self._alloc_expandable(pool, size, stream)
        alloc = allocation_size(size)
        if not self._fits(alloc):
            return None
        seg = self._new_segment(alloc, pool.small)
        block = _Block(self._next_addr, alloc, seg, stream)
        self._next_addr += alloc
        self.device_mallocs += 1
        self._grow(alloc)
        return block

    def _new_segment(self, nbytes: int, small: bool) -> int:
        seg = self._seg_counter
        self._seg_counter += 1
        self._segments[seg] = nbytes
        self._segment_small[seg] = small
        return seg

    def _alloc_expandable(self, pool: _Pool, size: int, stream: int) -> _Block | None:
        """`try_allocate_expandable_block`: map pages at the end of this stream's segment of the pool, merged
        with the free block before them (`find_expandable_block`, `map_block`)."""
        page = K_SMALL_BUFFER if pool.small else K_LARGE_BUFFER
        tail = self._tails.get((stream, pool.small))
        if tail is None:  # a new segment: one virtual range, nothing mapped yet
            tail = _Block(self._next_addr, _ADDRESS_SPACE, self._new_segment(0, pool.small), stream, mapped=False)
            self._segment_base[tail.segment] = self._next_addr
            self._next_addr += _ADDRESS_SPACE
            self._tails[(stream, pool.small)] = tail
        before = tail.prev if tail.prev is not None and not tail.prev.allocated else None
        have = before.size if before is not None else 0
        mapped = page * ((size - have + page - 1) // page)
        if not self._fits(mapped):
            return None
        self.device_mallocs += 1
        self._segments[tail.segment] += mapped
        self._grow(mapped)
        if before is not None:
            pool.remove(before)
            before.size += mapped
            block = before
        else:
            block = _Block(tail.addr, mapped, tail.segment, stream)
            block.prev = tail.prev
            if tail.prev is not None:
                tail.prev.next = block
        block.next = tail
        tail.prev = block
        tail.addr += mapped
        tail.size -= mapped
        return block

    def stats(self) -> tuple[int, int]:
        return self.allocated, self.reserved

    @property
    def segment_count(self) -> int:
        return len(self._segments)

