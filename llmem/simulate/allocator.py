"""The caching-allocator model, re-exported where `simulate` and its tests import it: the rules live in
llmem/allocator.py (torch-free, so the estimate replays its own request stream through the same model)."""

from llmem.allocator import (  # noqa: F401 (re-exported)
    K_LARGE_BUFFER,
    K_MIN_BLOCK,
    K_MIN_LARGE_ALLOC,
    K_ROUND_LARGE,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
    NO_LIMIT,
    CachingAllocator,
    allocation_size,
    round_size,
)
from llmem.simulate.replay import AllocatorStats, replay  # noqa: F401 (re-exported)
