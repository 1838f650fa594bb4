"""A moment of the walk: its name and its live bytes by category (`Phase`), built from named parts (`moment`)."""

from __future__ import annotations

from operator import itemgetter

from llmem.components import Category


class Phase(tuple):
    """A moment: `name`, `breakdown` (Category -> bytes) and `total` (the breakdown's sum). A tuple underneath: a
    walk, or the compiled record of one (`walk.replay`), makes up to ~180 of them per estimate, and a tuple is built
    in one step; nothing mutates a Phase. Equal when the names and breakdowns are (`total` follows from them)."""

    __slots__ = ()

    def __new__(cls, name: str, breakdown: dict, total: int | None = None) -> Phase:
        return tuple.__new__(cls, (name, breakdown, sum(breakdown.values()) if total is None else total))

    name = property(itemgetter(0))
    breakdown = property(itemgetter(1))
    total = property(itemgetter(2))

    def __eq__(self, other) -> bool:
        if type(other) is not Phase:
            return NotImplemented
        return self[0] == other[0] and self[1] == other[1]

    def __ne__(self, other) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = None  # a dict inside: unhashable, as the frozen dataclass it replaces

    def __getnewargs__(self) -> tuple:  # pickle: rebuilt through __new__ with its three fields
        return tuple(self)

    def __repr__(self) -> str:
        return f"Phase(name={self[0]!r}, breakdown={self[1]!r})"


_P, _G, _O, _A, _L, _C, _T = Category  # in the breakdown's order


def moment(name: str, parameters: int = 0, gradients: int = 0, optimizer: int = 0, activations: int = 0,
           logits: int = 0, communication: int = 0, standing: int = 0, temporaries: int = 0) -> Phase:
    """The phase `name` with its parts per category (`standing` is a communication buffer), in `Category` order
    (`0 + part`: a plain int where a part is a bool)."""
    c = 0 + communication + standing
    return Phase(name, {_P: 0 + parameters, _G: 0 + gradients, _O: 0 + optimizer, _A: 0 + activations,
                        _L: 0 + logits, _C: c, _T: 0 + temporaries},
                 0 + parameters + gradients + optimizer + activations + logits + c + temporaries)


def with_extra(phase: Phase, name: str, category: Category, extra: int) -> Phase:
    """`phase` renamed, with `extra` bytes more in `category`."""
    b = dict(phase.breakdown)
    b[category] += extra
    return Phase(name, b)
