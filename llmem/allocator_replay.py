"""`max_memory_reserved` of a request stream through the caching-allocator model's rules (llmem/allocator.py,
c10/cuda/CUDACachingAllocator.cpp, torch 2.13) in the one setting the estimate replays: default segments, no
`max_split_size`, `roundup_power2_divisions` or garbage collection, capacity unlimited, nothing emptied. In that
setting a segment is never given back, so the reserved peak is the bytes of every segment made; the rules are
`CachingAllocator`'s, the same to the byte (scripts/check_replay_identity.py, tests/test_allocator_replay.py), in
one loop over flat blocks instead of an object per block and method calls per request:

  round_size / get_pool   a request rounded up to 512 B; <= 1 MiB the small pool; pools per (stream, pool).
  get_free_block  the pool's free blocks kept as one sorted list of keys size · 2^64 + address (the order of
                  `BlockComparatorSize`, an ordered std::set): `bisect` finds the smallest block >= the request,
                  lowest address first, like the set's `lower_bound`.
  alloc_block     nothing fits: a new segment of `get_allocation_size` bytes at the next address.
  should_split    small pool: remainder >= 512 B; large pool: remainder > 1 MiB; the remainder a free block linked
                  after the handed-out one.
  free_block      merged with its free neighbours through the block's links (`try_merge_blocks`), no search.
What follows from a request's bytes alone (the rounding, the pool, the split bound, the new segment's bytes) is
worked out once per distinct (bytes, stream) of the replay (`_resolver`) and looked up per request.
"""

from __future__ import annotations

from bisect import bisect_left, insort

from llmem.allocator import K_SMALL_SIZE, allocation_size

_MASK = (1 << 64) - 1  # key: size << 64 | address (addresses stay below 2^64 bytes)
ADDR, SIZE, PREV, NEXT, USED, POOL = range(6)  # a block: [address, size, prev, next, allocated, its pool's keys]


def _resolver(slots: dict | None):
    """(bytes or slot, stream) -> what `malloc` derives from the bytes alone: (size · 2^64, size, the least remainder
    split off, its pool's free keys, the bytes of a new segment for it); None for a free (bytes <= 0, or a slot of 0
    bytes: a request not made, its key never live)."""
    get, pools = (slots or {}).get, {}

    def resolve(nbytes, stream: int):
        nbytes = get(nbytes, nbytes)
        if nbytes <= 0:
            return None
        size = 512 if nbytes <= 512 else (nbytes + 511) & ~511  # round_size
        small = size <= K_SMALL_SIZE  # get_pool; should_split's bound: small >= 512 B, large > 1 MiB
        keys = pools.setdefault(2 * stream + small, [])
        return size << 64, size, 512 if small else K_SMALL_SIZE + 1, keys, allocation_size(size)
    return resolve


def peak_reserved(events, slots: dict | None = None) -> int:
    """The reserved bytes after `events` ((key, bytes, stream); bytes <= 0 frees the request `key`; bytes may
    name a slot of `slots`, whose value it stands for), default segments; the same figure as
    `CachingAllocator().malloc/free` then `.peak_reserved`."""
    resolve, resolved = _resolver(slots), {}  # stream -> {bytes or slot: resolve(...)}
    default = resolved[0] = {}
    free_at: dict[int, list] = {}  # address -> the free block there
    live: dict = {}  # request key -> its block
    reserved = 0
    for key, nbytes, stream in events:
        known = default if not stream else resolved.setdefault(stream, {})
        try:
            request = known[nbytes]
        except KeyError:
            request = known[nbytes] = resolve(nbytes, stream)
        if request is None:  # free_block
            b = live.pop(key, None)
            if b is None:
                continue
            keys, prev, nxt = b[POOL], b[PREV], b[NEXT]
            b[USED] = False
            if prev is not None and not prev[USED]:
                del keys[bisect_left(keys, (prev[SIZE] << 64) + prev[ADDR])]
                del free_at[prev[ADDR]]
                b[ADDR], b[SIZE], b[PREV] = prev[ADDR], prev[SIZE] + b[SIZE], prev[PREV]
                if prev[PREV] is not None:
                    prev[PREV][NEXT] = b
            if nxt is not None and not nxt[USED]:
                del keys[bisect_left(keys, (nxt[SIZE] << 64) + nxt[ADDR])]
                del free_at[nxt[ADDR]]
                b[SIZE] += nxt[SIZE]
                b[NEXT] = nxt = nxt[NEXT]
                if nxt is not None:
                    nxt[PREV] = b
            free_at[b[ADDR]] = b
            insort(keys, (b[SIZE] << 64) + b[ADDR])
            continue
        shifted, size, split, keys, segment = request
        i = bisect_left(keys, shifted)
        if i < len(keys):  # get_free_block: the smallest free block >= size, lowest address first
            b = free_at.pop(keys.pop(i) & _MASK)
        else:  # alloc_block: a new segment, laid out after the others from address 0
            b = [reserved, segment, None, None, False, keys]
            reserved += segment
        rest = b[SIZE] - size
        if rest >= split:  # should_split: the remainder a free block after it
            nxt = b[NEXT]
            r = [b[ADDR] + size, rest, b, nxt, False, keys]
            if nxt is not None:
                nxt[PREV] = r
            b[NEXT], b[SIZE] = r, size
            free_at[r[ADDR]] = r
            insort(keys, (rest << 64) + r[ADDR])
        b[USED] = True
        live[key] = b
    return reserved
