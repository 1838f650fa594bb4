"""A moment of the walk: its name and its live bytes by category (`Phase`), built from named parts (`moment`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmem.components import Category


@dataclass(frozen=True, init=False)
class Phase:
    name: str
    breakdown: dict  # Category -> bytes
    total: int = field(repr=False, compare=False)  # the breakdown's sum

    def __init__(self, name: str, breakdown: dict, total: int | None = None) -> None:
        # a walk makes dozens of phases per estimate: the fields are set in one go (the dataclass is frozen)
        self.__dict__.update(name=name, breakdown=breakdown,
                             total=sum(breakdown.values()) if total is None else total)


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
