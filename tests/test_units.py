"""The formatters at the edge: binary GiB, labelled; SI parameter counts."""

import pytest

from llmem.units import format_gib, format_params


@pytest.mark.parametrize("n,text", [(0, "0.00 GiB"), (1 << 30, "1.00 GiB"), (13_421_772_800, "12.50 GiB"),
                                    (80 * (1 << 30) - 1, "80.00 GiB")])
def test_format_gib(n, text):
    assert format_gib(n) == text


@pytest.mark.parametrize("n,text", [(8_030_261_248, "8.03 B"), (124_439_808, "124.4 M"), (405_853_388_800, "405.85 B"),
                                    (1_500, "1.5 K"), (7, "7")])
def test_format_params(n, text):
    assert format_params(n) == text
