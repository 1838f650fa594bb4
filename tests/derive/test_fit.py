"""The exact fit of a traced size in (batch, seq): coefficients recovered from sizes computed directly as products of
dimensions, and anything that is not such a polynomial refused."""

import pytest

from llmem.derive.fit import REGIMES, evaluate, fit_sequence, regime
from llmem.errors import InputError


def _sizes(size, kind):
    points, checks, _ = REGIMES[kind]
    return [[("t: op", size(b, s))] for b, s in points], [[("t: op", size(b, s))] for b, s in checks]


# each a tensor's bytes written as the product of its dimensions (h=64, heads=4, kv width 32, vocab 256)
SHAPES = {
    "hidden states fp32": lambda b, s: b * s * 64 * 4,
    "eager scores fp32": lambda b, s: b * 4 * s * s * 4,
    "rope cos (1, s, 16) bf16": lambda b, s: 1 * s * 16 * 2,
    "mask (1, 1, s, s) bool": lambda b, s: s * s,
    "per-row int64": lambda b, s: b * 8,
    "norm (1 + weight) fp32": lambda b, s: 64 * 4,
    "sum of the above": lambda b, s: b * s * 256 + b * 16 * s * s + 32 * s + s * s + 8 * b + 256,
}


@pytest.mark.parametrize("kind", REGIMES)
@pytest.mark.parametrize("name", SHAPES)
def test_fit_reproduces_the_product_of_dimensions_at_other_sizes(name, kind):
    size = SHAPES[name]
    traces, checks = _sizes(size, kind)
    [(_, coeffs)] = fit_sequence("place", traces, checks, kind)
    for b, s in ((1, 4096), (1, 7), (2, 4096), (8, 131072), (3, 1)):
        if regime(b) == kind:
            assert evaluate(coeffs, b, s) == size(b, s)


def test_a_size_that_is_no_polynomial_is_refused():
    traces, checks = _sizes(lambda b, s: b * s * (s.bit_length()), "batched")
    with pytest.raises(InputError, match="model_type"):
        fit_sequence("place", traces, checks, "batched")


def test_a_tensor_list_that_changes_with_the_size_is_refused():
    traces, checks = _sizes(lambda b, s: b * s, "batched")
    checks[0] = checks[0] + [("u: op", 8)]
    with pytest.raises(InputError, match="change with batch or sequence length"):
        fit_sequence("place", traces, checks, "batched")
