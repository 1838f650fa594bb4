"""`simulate`'s replay of a recorded allocation sequence through the caching-allocator model (llmem/allocator.py):
the statistics torch.cuda reports after `reset_peak_memory_stats()`."""

from llmem.simulate.replay import replay

MiB = 1 << 20


def test_replay_reports_peaks_after_reset():
    """`resetPeakStats`: peaks restart from the current values (cached segments stay in reserved)."""
    events = [(0, 0, 30 * MiB), (1, 0, -30 * MiB), (2, 1, 10 * MiB), (3, 2, 4 * MiB), (4, 2, -4 * MiB)]
    stats = replay(events, reset_index=2)
    assert stats.max_allocated == 14 * MiB  # the 30 MiB before the reset does not count
    assert stats.max_reserved == 30 * MiB and stats.reserved_at_reset == 30 * MiB
    assert stats.allocated_at_peak == 14 * MiB
    on_two = replay(events, reset_index=2, streams=[0, 1, 1])
    assert on_two.max_reserved == 30 * MiB + 20 * MiB + 10 * MiB  # stream 1 cannot use stream 0's segment
