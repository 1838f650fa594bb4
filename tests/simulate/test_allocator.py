"""The caching-allocator model against rules read from c10/cuda/CUDACachingAllocator.cpp."""

from llmem.simulate.allocator import (
    K_LARGE_BUFFER,
    K_SMALL_BUFFER,
    CachingAllocator,
    allocation_size,
    replay,
    round_size,
)

MiB = 1 << 20


def test_round_size_and_segment_sizes():
    assert round_size(1) == 512 and round_size(512) == 512 and round_size(513) == 1024
    assert allocation_size(1 * MiB) == K_SMALL_BUFFER  # small pool: 2 MiB segments
    assert allocation_size(MiB + 512) == K_LARGE_BUFFER  # 1..10 MiB: 20 MiB segments
    assert allocation_size(10 * MiB) == 10 * MiB  # >= 10 MiB: rounded to 2 MiB
    assert allocation_size(10 * MiB + 1) == 12 * MiB


def test_small_requests_share_a_2mib_segment():
    a = CachingAllocator()
    blocks = [a.malloc(1000) for _ in range(4)]
    assert a.reserved == K_SMALL_BUFFER and a.allocated == 4 * 1024
    for b in blocks:
        a.free(b)
    assert a.allocated == 0 and a.reserved == K_SMALL_BUFFER  # cached, not returned


def test_large_split_only_when_remainder_over_1mib():
    a = CachingAllocator()
    b1 = a.malloc(3 * MiB)  # 20 MiB segment, split: 17 MiB cached
    assert a.reserved == 20 * MiB and a.allocated == 3 * MiB
    b2 = a.malloc(16 * MiB + 512 * 1024)  # fits the 17 MiB block, remainder 0.5 MiB: not split
    assert a.reserved == 20 * MiB and a.allocated == 20 * MiB  # the whole block counts as allocated
    a.free(b1)
    a.free(b2)
    assert a.allocated == 0


def test_fragmentation_from_a_hole():
    a = CachingAllocator()
    x = a.malloc(12 * MiB)
    y = a.malloc(12 * MiB)
    a.free(x)
    z = a.malloc(14 * MiB)  # does not fit the 12 MiB hole: a new segment
    assert a.reserved == 38 * MiB and a.allocated == 26 * MiB
    a.free(y)
    a.free(z)


def test_expandable_segments_grow_in_pages_without_holes():
    a = CachingAllocator(expandable_segments=True)
    x = a.malloc(12 * MiB)
    y = a.malloc(12 * MiB)
    assert a.reserved == 40 * MiB  # 20 MiB pages of the large pool
    a.free(x)
    z = a.malloc(14 * MiB)  # the free 12 MiB + the 8 MiB left at the end of the mapped range do not touch
    assert a.allocated == 26 * MiB
    a.free(y)
    a.free(z)


def test_replay_reports_peaks_after_reset():
    events = [(0, 0, 30 * MiB), (1, 0, -30 * MiB), (2, 1, 10 * MiB), (3, 2, 4 * MiB), (4, 2, -4 * MiB)]
    stats = replay(events, reset_index=2)
    assert stats.max_allocated == 14 * MiB  # the 30 MiB before the reset does not count
    assert stats.max_reserved == 30 * MiB  # both later requests are carved from the cached 30 MiB segment
    assert stats.allocated_at_peak == 14 * MiB
