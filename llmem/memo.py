"""Bounded memo stores: a value computed once per key, the store emptied at `limit` keys (values are computed again
when asked again), so a long-running app stays bounded. Used by the spec's term caches (`ModelSpec.memo`), the plan
keys (`plan.field_key`), FSDP2's compute plans and a derived model's fits (`llmem.derive.tables`)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

T = TypeVar("T")
LIMIT = 4096
_MISSING = object()


def remembered(store: dict, key: Hashable, compute: Callable[[], T], limit: int = LIMIT) -> T:
    """`store[key]`, computed by `compute()` the first time (one lookup: another thread may empty the store)."""
    value = store.get(key, _MISSING)
    if value is _MISSING:
        value = compute()
        if len(store) >= limit:
            store.clear()
        store[key] = value
    return value
