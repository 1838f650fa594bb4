"""The caching-allocator model, one test per rule of c10/cuda/CUDACachingAllocator.cpp (torch 2.13,
`DeviceCachingAllocator`): each feeds an allocation sequence and checks the reserved / allocated bytes the
source's rule gives (the function named in each docstring)."""

from llmem.allocator import (
    K_LARGE_BUFFER,
    K_SMALL_BUFFER,
    CachingAllocator,
    allocation_size,
    round_size,
)

MiB = 1 << 20


def test_round_size_512_bytes_and_power2_divisions():
    """`round_size`: multiples of kMinBlockSize = 512; `roundup_power2_next_division` when set (the source's
    own example: 1200 B in 4 divisions of 1024..2048 rounds to 1280, once 1200 > 512 · divisions holds)."""
    assert round_size(1) == 512 and round_size(512) == 512 and round_size(513) == 1024
    assert round_size(1200, divisions=2) == 1536  # 1200 > 1024: divisions 1024, 1536
    assert round_size(1200, divisions=4) == 1536  # 1200 <= 2048: plain 512-B rounding
    assert round_size(9000, divisions=4) == 10240  # 8192 + 2048
    assert round_size(8192, divisions=4) == 8192  # a power of two stays


def test_get_pool_small_up_to_1mib_in_2mib_segments():
    """`get_pool` / `get_allocation_size`: <= 1 MiB small pool (2 MiB segments), else the large pool."""
    a = CachingAllocator()
    a.malloc(MiB)
    assert a.reserved == K_SMALL_BUFFER
    a.malloc(MiB + 1)
    assert a.reserved == K_SMALL_BUFFER + K_LARGE_BUFFER


def test_allocation_size_large_pool():
    """`get_allocation_size`: 20 MiB below kMinLargeAlloc = 10 MiB, else rounded up to 2 MiB."""
    assert allocation_size(MiB) == K_SMALL_BUFFER
    assert allocation_size(MiB + 512) == K_LARGE_BUFFER
    assert allocation_size(10 * MiB - 512) == K_LARGE_BUFFER
    assert allocation_size(10 * MiB) == 10 * MiB
    assert allocation_size(10 * MiB + 1) == 12 * MiB


def test_small_requests_share_a_2mib_segment_and_stay_cached():
    """`should_split` (small pool: remainder >= 512 B) and `free_block` (segments stay cached)."""
    a = CachingAllocator()
    blocks = [a.malloc(1000) for _ in range(4)]
    assert a.reserved == K_SMALL_BUFFER and a.allocated == 4 * 1024
    for b in blocks:
        a.free(b)
    assert a.allocated == 0 and a.reserved == K_SMALL_BUFFER


def test_large_split_only_when_remainder_over_1mib():
    """`should_split` (large pool: remainder > kSmallSize) and `alloc_found_block` (an unsplit block counts
    whole as allocated)."""
    a = CachingAllocator()
    b1 = a.malloc(3 * MiB)  # 20 MiB segment, split: 17 MiB cached
    assert a.reserved == 20 * MiB and a.allocated == 3 * MiB
    a.malloc(16 * MiB + 512 * 1024)  # fits the 17 MiB block, remainder 0.5 MiB: not split
    assert a.reserved == 20 * MiB and a.allocated == 20 * MiB
    a.free(b1)
    assert a.allocated == 17 * MiB


def test_best_fit_smallest_block_then_lowest_address():
    """`get_free_block` with `BlockComparatorSize`: smallest cached block >= request, ties by address."""
    a = CachingAllocator()
    x, y, z = (a.malloc(n * MiB) for n in (14, 12, 12))  # one segment each (>= 10 MiB: 2 MiB rounding)
    for b in (x, z, y):
        a.free(b)
    got = a.malloc(11 * MiB)  # 12 - 11 = 1 MiB is not > kSmallSize: handed out unsplit
    assert got.addr == y.addr and a.reserved == 38 * MiB and a.allocated == 12 * MiB


def test_fragmentation_from_a_hole():
    """No cached block is large enough: a new segment even though enough bytes are free in total."""
    a = CachingAllocator()
    x = a.malloc(12 * MiB)
    a.malloc(12 * MiB)
    a.free(x)
    a.malloc(14 * MiB)
    assert a.reserved == 38 * MiB and a.allocated == 26 * MiB


def test_free_merges_with_free_neighbours():
    """`free_block` → `try_merge_blocks`: two freed neighbours in one segment serve a request of their sum."""
    a = CachingAllocator()
    b1, b2 = a.malloc(3 * MiB), a.malloc(3 * MiB)
    a.malloc(3 * MiB)
    a.free(b1)
    a.free(b2)
    a.malloc(17 * MiB)  # 6 MiB merged at the front + 11 MiB at the back are not adjacent: an 18 MiB segment
    assert a.reserved == 20 * MiB + 18 * MiB
    got = a.malloc(6 * MiB)
    assert got.addr == b1.addr and a.reserved == 38 * MiB


def test_max_split_size_oversize_blocks():
    """`get_free_block` / `should_split` with max_split_size: a smaller request never takes an oversize block,
    a larger one only takes a block < request + kLargeBuffer, and oversize blocks are handed out unsplit."""
    a = CachingAllocator(max_split_size=32 * MiB)
    a.free(a.malloc(40 * MiB))
    a.malloc(12 * MiB)  # below max_split: may not take the 40 MiB block
    assert a.reserved == 52 * MiB
    a.malloc(36 * MiB)  # >= max_split, 40 < 36 + 20: takes the 40 MiB block whole
    assert a.reserved == 52 * MiB and a.allocated == 52 * MiB
    b = CachingAllocator(max_split_size=32 * MiB)
    b.free(b.malloc(100 * MiB))
    b.malloc(40 * MiB)  # 100 >= 40 + 20: not taken
    assert b.reserved == 140 * MiB


def test_streams_never_share_cached_blocks():
    """`BlockComparatorSize` orders by stream first and `get_free_block` refuses a block of another stream."""
    a = CachingAllocator()
    a.free(a.malloc(12 * MiB, stream=0))
    a.malloc(12 * MiB, stream=1)
    assert a.reserved == 24 * MiB
    a.malloc(12 * MiB, stream=0)  # the cached block of stream 0
    assert a.reserved == 24 * MiB


def test_capacity_releases_cached_segments_then_retries():
    """malloc's failure path: `release_cached_blocks` frees unsplit cached segments, then `alloc_block` again."""
    a = CachingAllocator(capacity=40 * MiB)
    a.free(a.malloc(30 * MiB))
    a.malloc(35 * MiB)
    assert a.reserved == 36 * MiB and a.ooms == 1


def test_release_available_cached_blocks_with_max_split():
    """`release_available_cached_blocks`: with max_split_size, an oversize cached block is freed first."""
    a = CachingAllocator(capacity=100 * MiB, max_split_size=32 * MiB)
    a.free(a.malloc(60 * MiB))
    a.malloc(20 * MiB)  # below max_split: a new segment, 80 MiB reserved
    a.malloc(30 * MiB)  # 80 + 30 > 100: the 60 MiB oversize block goes, no full release (ooms stays 0)
    assert a.reserved == 50 * MiB and a.ooms == 0


def test_garbage_collection_threshold_needs_a_memory_fraction():
    """`garbage_collect_cached_blocks` runs before a new segment only with a fraction set
    (`set_fraction && garbage_collection_threshold > 0`): reserved above threshold × allowed frees old
    unsplit blocks."""
    def run(**kw) -> int:
        a = CachingAllocator(capacity=100 * MiB, garbage_collection_threshold=0.5, **kw)
        x = a.malloc(30 * MiB)
        a.malloc(30 * MiB)
        a.free(x)
        a.malloc(40 * MiB)
        return a.reserved

    assert run() == 100 * MiB
    assert run(memory_fraction=1.0) == 70 * MiB


def test_empty_cache_frees_whole_segments_only():
    """`emptyCache` → `release_cached_blocks` → `release_blocks`: unsplit cached blocks only."""
    a = CachingAllocator()
    a.malloc(3 * MiB)  # a 20 MiB segment, split: 17 MiB cached but not releasable
    a.free(a.malloc(30 * MiB))  # its own 30 MiB segment, cached whole
    a.empty_cache()
    assert a.reserved == 20 * MiB and a.allocated == 3 * MiB


def test_expandable_segments_grow_in_pages_without_holes():
    """`try_allocate_expandable_block` / `map_block`: 20 MiB pages at the end of the segment; the free block before
    the unmapped tail grows in place."""
    a = CachingAllocator(expandable_segments=True)
    x = a.malloc(12 * MiB)
    y = a.malloc(12 * MiB)
    assert a.reserved == 40 * MiB
    a.free(x)
    a.malloc(14 * MiB)  # the 16 MiB free at the end (split: a 2 MiB rest); cudaMalloc segments would need 38
    assert a.reserved == 40 * MiB and a.allocated == 26 * MiB
    a.free(y)
    a.malloc(24 * MiB)  # 12 + 12 merged at the front
    assert a.reserved == 40 * MiB
    a.malloc(4 * MiB)  # the 2 MiB at the end + one more 20 MiB page
    assert a.reserved == 60 * MiB


def test_expandable_segments_one_per_stream_and_empty_cache_unmaps():
    """Expandable segments are per stream (`find_expandable_block` searches the stream's unmapped blocks);
    `release_blocks` → `unmap_block` unmaps free pages and releases a fully unmapped segment."""
    a = CachingAllocator(expandable_segments=True)
    a.malloc(12 * MiB, stream=0)
    a.free(a.malloc(12 * MiB, stream=1))
    assert a.reserved == 40 * MiB
    a.empty_cache()
    assert a.reserved == 20 * MiB and a.segment_count == 1
