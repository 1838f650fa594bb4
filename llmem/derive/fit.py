"""Exact integer fit of a traced tensor's bytes as a function of the micro-batch b and the sequence length s.

A saved tensor's size is a product of its dimensions: b·s-sized (hidden states, projections), b·s²-sized (eager
attention scores), s- or s²-sized (RoPE tables, a mask shared over the batch), b-sized, or constant (a norm's
`1 + weight`). So bytes = Σ cₖ·mₖ(b, s) over the monomials below, with integer coefficients. The fit solves it
exactly (rational Gaussian elimination) and checks it on further points; anything else is refused.
A micro-batch of 1 is its own regime: some ops allocate differently there (a matmul operand broadcast over a batch
of 1 stays a view, a copy otherwise), so it is fitted apart, as a polynomial in s alone (`REGIMES`).
Pure Python: no torch.
"""

from __future__ import annotations

from fractions import Fraction

from llmem.errors import InputError

MONOMIALS = ("b*s", "b*s^2", "s", "s^2", "b", "1")
# regime -> (fit points, check points, the monomials fitted: with b = 1 only s, s^2 and 1 are independent)
REGIMES = {
    "single": (((1, 8), (1, 12), (1, 16)), ((1, 20), (1, 6)), (2, 3, 5)),
    "batched": (((2, 8), (2, 12), (2, 16), (3, 8), (3, 12), (4, 16)), ((3, 20), (4, 8)), (0, 1, 2, 3, 4, 5)),
}


def regime(batch: int) -> str:
    return "single" if batch == 1 else "batched"


def shifted(kind: str, offset: int) -> tuple:
    """Regime `kind`'s (fit points, check points, basis) with every sequence length moved up by `offset` (a band
    of sequence lengths at or above a sliding window, `llmem.derive.config_reads.band`)."""
    points, checks, basis = REGIMES[kind]
    return (tuple((b, s + offset) for b, s in points), tuple((b, s + offset) for b, s in checks), basis)


def monomials(b: int, s: int) -> tuple[int, ...]:
    return (b * s, b * s * s, s, s * s, b, 1)


def solve(values: list[int], points, basis) -> tuple[int, ...]:
    """The integer coefficients c (of every monomial; 0 outside `basis`) with Σ cₖ·mₖ(b, s) = values[j] at
    points[j] (square and invertible on `basis`)."""
    rows = [[Fraction(monomials(b, s)[i]) for i in basis] + [Fraction(v)]
            for (b, s), v in zip(points, values, strict=True)]
    n = len(basis)
    for col in range(n):
        pivot = next(r for r in range(col, n) if rows[r][col] != 0)
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(n):
            if r != col and rows[r][col] != 0:
                f = rows[r][col] / rows[col][col]
                rows[r] = [a - f * c for a, c in zip(rows[r], rows[col], strict=True)]
    coeffs = [rows[i][n] / rows[i][i] for i in range(n)]
    if any(c.denominator != 1 for c in coeffs):
        raise InputError("model_type", "a traced tensor's size is not a polynomial in batch and sequence length; "
                         "this architecture cannot be derived (use a modelled family)")
    full = [0] * len(MONOMIALS)
    for i, c in zip(basis, coeffs, strict=True):
        full[i] = int(c)
    return tuple(full)


def evaluate(coeffs: tuple[int, ...], b: int, s: int) -> int:
    return sum(c * m for c, m in zip(coeffs, monomials(b, s), strict=True))


def fit_sequence(name: str, traces: list[list[tuple[str, int]]], checks: list[list[tuple[str, int]]],
                 kind: str, offset: int = 0) -> list:
    """Fit each tensor of one place (same savers, same order at every point): [(name, coefficients)].
    `traces` are the lists at regime `kind`'s fit points, `checks` at its check points."""
    points, check_points, basis = shifted(kind, offset)
    first = [n for n, _ in traces[0]]
    savers = [n.split(": ")[0] for n in first]  # "<saving module>: <allocating op> <dtype>"
    for t in traces[1:] + checks:
        if [n.split(": ")[0] for n, _ in t] != savers:
            raise InputError("model_type", f"{name}: the tensors saved change with batch or sequence length; "
                             "this architecture cannot be derived (use a modelled family)")
    out = []
    for k, tensor in enumerate(first):
        coeffs = solve([t[k][1] for t in traces], points, basis)
        for (b, s), t in zip(check_points, checks, strict=True):
            if evaluate(coeffs, b, s) != t[k][1]:
                raise InputError("model_type", f"{name}: {tensor} does not follow a polynomial in batch and "
                                 "sequence length; this architecture cannot be derived")
        out.append((tensor, coeffs))
    return out
