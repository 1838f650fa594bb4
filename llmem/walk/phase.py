"""A moment of the walk: its name and its live bytes by category (`Phase`), built from named parts (`moment`)."""

from __future__ import annotations

from dataclasses import dataclass

from llmem.components import Category


@dataclass(frozen=True)
class Phase:
    name: str
    breakdown: dict  # Category -> bytes

    @property
    def total(self) -> int:
        return sum(self.breakdown.values())


_PART_CATEGORY = {c.name.lower(): c for c in Category} | {"standing": Category.COMMUNICATION}
_EMPTY = dict.fromkeys(Category, 0)


def moment(name: str, **parts: int) -> Phase:
    """The phase `name` with its parts summed per category (`standing` is a communication buffer)."""
    breakdown = dict(_EMPTY)
    for key, value in parts.items():
        breakdown[_PART_CATEGORY[key]] += value
    return Phase(name, breakdown)


def with_extra(phase: Phase, name: str, category: Category, extra: int) -> Phase:
    """`phase` renamed, with `extra` bytes more in `category`."""
    b = dict(phase.breakdown)
    b[category] += extra
    return Phase(name, b)
