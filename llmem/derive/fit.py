"""Exact integer fit of a traced tensor's bytes as a function of the micro-batch b and the sequence length s.

A saved tensor's size is a product of its dimensions: b·s-sized (hidden states, projections), b·s²-sized (eager
attention scores), s- or s²-sized (RoPE tables, a mask shared over the batch), b-sized, or constant (a norm's
`1 + weight`). So bytes = Σ cₖ·mₖ(b, s) over the monomials below, with integer coefficients. The fit solves it
exactly (rational Gaussian elimination) on `POINTS` and checks it on `CHECKS`; anything else is refused.
Pure Python: no torch.
"""

from __future__ import annotations

from fractions import Fraction

from llmem.errors import InputError

MONOMIALS = ("b*s", "b*s^2", "s", "s^2", "b", "1")
POINTS = ((1, 8), (1, 12), (1, 16), (2, 8), (2, 12), (3, 16))
CHECKS = ((2, 20), (3, 8))


def monomials(b: int, s: int) -> tuple[int, ...]:
    return (b * s, b * s * s, s, s * s, b, 1)


def solve(values: list[int], points=POINTS) -> tuple[int, ...]:
    """The integer coefficients c with Σ cₖ·mₖ(b, s) = values[j] at points[j] (a square, invertible system)."""
    rows = [[Fraction(x) for x in monomials(b, s)] + [Fraction(v)] for (b, s), v in zip(points, values)]
    n = len(MONOMIALS)
    for col in range(n):
        pivot = next(r for r in range(col, n) if rows[r][col] != 0)
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(n):
            if r != col and rows[r][col] != 0:
                f = rows[r][col] / rows[col][col]
                rows[r] = [a - f * c for a, c in zip(rows[r], rows[col])]
    coeffs = [rows[i][n] / rows[i][i] for i in range(n)]
    if any(c.denominator != 1 for c in coeffs):
        raise InputError("model_type", "a traced tensor's size is not a polynomial in batch and sequence length; "
                         "this architecture cannot be derived (use a modelled family)")
    return tuple(int(c) for c in coeffs)


def evaluate(coeffs: tuple[int, ...], b: int, s: int) -> int:
    return sum(c * m for c, m in zip(coeffs, monomials(b, s)))


def fit_sequence(name: str, traces: list[list[tuple[str, int]]], checks: list[list[tuple[str, int]]]) -> list:
    """Fit each tensor of one place (same names, same order at every point): [(name, coefficients)].
    `traces` are the lists at `POINTS`, `checks` at `CHECKS`."""
    first = [n for n, _ in traces[0]]
    savers = [n.split(": ")[0] for n in first]  # "<saving module>: <allocating op> <dtype>"
    for t in traces[1:] + checks:
        if [n.split(": ")[0] for n, _ in t] != savers:
            raise InputError("model_type", f"{name}: the tensors saved change with batch or sequence length; "
                             "this architecture cannot be derived (use a modelled family)")
    out = []
    for k, tensor in enumerate(first):
        coeffs = solve([t[k][1] for t in traces])
        for (b, s), t in zip(CHECKS, checks):
            if evaluate(coeffs, b, s) != t[k][1]:
                raise InputError("model_type", f"{name}: {tensor} does not follow a polynomial in batch and "
                                 "sequence length; this architecture cannot be derived")
        out.append((tensor, coeffs))
    return out
