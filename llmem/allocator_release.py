"""How the caching-allocator model (llmem/allocator.py) gives cached memory back to the device, after
c10/cuda/CUDACachingAllocator.cpp (torch 2.13, `DeviceCachingAllocator`):

  release_cached_blocks   (`emptyCache`, and malloc's last retry) every cached block that is a whole segment
                          (`release_blocks`: `!block->prev && !block->next`) is cudaFree'd; with expandable
                          segments the free pages are unmapped (`unmap_block`) — modelled for the free block at
                          the end of the mapped range, where every page a training step frees ends up; a fully
                          unmapped segment is released (`release_expandable_segment`).
  release_available_cached_blocks  only with max_split_size: the smallest cached oversize block (>= max_split_size)
                          of the pool and stream that covers the request, else the largest ones until their sum does.
  garbage_collect_cached_blocks  only with `garbage_collection_threshold` and a memory fraction, before a new
                          segment is made: while reserved exceeds threshold × allowed, free the unsplit large-pool
                          blocks whose age (get_free_block calls on the pool since the block was cached) is at least
                          the mean age, oldest rounds first.
"""

from __future__ import annotations


class ReleaseMixin:
    """Mixed into `CachingAllocator` (attributes: pools, reserved, max_split, gc_threshold, allowed, ...)."""

    def empty_cache(self) -> None:
        """`torch.cuda.empty_cache()` → `emptyCache` → `release_cached_blocks`."""
        self.release_cached_blocks()

    def release_cached_blocks(self) -> bool:
        for pool in list(self.pools.values()):
            for key in list(pool.keys):
                block = pool.blocks.get(key)
                if block is None:
                    continue
                if self.expandable:
                    self._unmap_tail_block(pool, block)
                elif not block.is_split:
                    self._release_block(pool, block)
        return True

    def _release_block(self, pool, block) -> None:
        """`release_block`: cudaFree of a whole cached segment."""
        pool.remove(block)
        self.reserved -= block.size
        self._segments.pop(block.segment, None)

    def _unmap_tail_block(self, pool, block) -> None:
        tail = block.next
        if tail is None or tail.mapped:
            return  # an interior free range: its whole pages would be unmapped too (not modelled)
        page = (2 << 20) if pool.small else (20 << 20)
        base = self._segment_base[block.segment]
        start = base + -(-(block.addr - base) // page) * page  # `unmap`: whole pages only (segmentRight)
        end = block.addr + block.size
        if start >= end:
            return
        pool.remove(block)
        self.reserved -= end - start
        self._segments[block.segment] -= end - start
        tail.addr, tail.size = start, tail.size + end - start
        if start > block.addr:  # the part of a page still in use stays a free mapped block
            block.size = start - block.addr
            block.next, tail.prev = tail, block
            pool.insert(block)
            return
        tail.prev = block.prev
        if block.prev is not None:
            block.prev.next = tail
            return
        del self._tails[(tail.stream, pool.small)]  # `release_expandable_segment`
        self._segments.pop(tail.segment, None)

    def release_available_cached_blocks(self, pool, size: int) -> bool:
        if self.max_split >= 1 << 62:
            return False
        want = max(size, self.max_split)
        i = pool.lower_bound(want)
        if i < len(pool.keys):
            self._release_block(pool, pool.blocks[pool.keys[i]])
            return True
        released = 0
        for key in reversed(list(pool.keys)):
            block = pool.blocks[key]
            if released >= want or block.size < self.max_split:
                break
            released += block.size
            self._release_block(pool, block)
        return released >= want

    def garbage_collect_cached_blocks(self) -> None:
        threshold = int(self.gc_threshold * self.allowed)
        if self.reserved <= threshold:
            return
        target, reclaimed = self.reserved - threshold, 0
        large = [p for (_, small), p in self.pools.items() if not small]
        freeable = [(p, b) for p in large for b in p.blocks.values() if not b.is_split]
        while freeable and reclaimed < target:
            ages = [p.calls[0] - b.gc_base for p, b in freeable]
            mean = sum(ages) / len(ages)
            old = [pb for pb, age in zip(freeable, ages, strict=True) if age >= mean]
            if not old:
                break
            for p, b in old:
                reclaimed += b.size
                self._release_block(p, b)
            freeable = [pb for pb in freeable if pb not in old]
