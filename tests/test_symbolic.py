"""`llmem.symbolic`: a Sym computes exactly what the plain int computes, and a record replayed elsewhere keeps
its guards: compared with Python's own integers over random expressions and points."""

import operator
import random

import pytest

from llmem.symbolic import Sym, Tape
from llmem.walk.phase import Phase
from llmem.walk.replay import compile_walk

OPS = (operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod)


def _expression(rng: random.Random, b, s):
    """A random expression over b, s and small constants, as the walk writes them (products, sums, // by a head
    count or a rank count, a max of two sizes, a branch on batch == 1)."""
    x = rng.choice((b, s, b * s, b * s * s))
    for _ in range(rng.randint(1, 5)):
        op, c = rng.choice(OPS), rng.choice((1, 2, 3, 4, 7, 8, 64, 4096, b, s))
        x = op(x, c)
    if rng.random() < 0.3:
        x = max(x, rng.choice((b, s)) * 100)
    if rng.random() < 0.3:
        x = x + (5 if b == 1 else 7 * b)
    return 0 + x


@pytest.mark.parametrize("seed", range(40))
def test_a_record_gives_what_the_integers_give_wherever_its_guards_hold(seed):
    """Traced at one point, the compiled record equals the plain-int expression at every other point where it
    answers (and answers at the traced point itself)."""
    rng = random.Random(seed)
    b0, s0 = rng.choice((1, 2, 4)), rng.choice((64, 100, 1024))
    tape = Tape()
    b, s = tape.variable(b0), tape.variable(s0)
    state = rng.getstate()
    value = _expression(rng, b, s)
    replay = compile_walk(tape, [Phase("x", {"v": value}, value)])
    assert replay(b0, s0)[0].total == (value.value if isinstance(value, Sym) else value)
    answered = 0
    for bb in (1, 2, 3, 4, 8):
        for ss in (1, 63, 64, 100, 1000, 1024, 4096):
            got = replay(bb, ss)
            rng.setstate(state)
            want = _expression(rng, bb, ss)
            if got is not None:
                answered += 1
                assert got[0].total == want and got[0].breakdown == {"v": want}
    assert answered >= 1


def test_a_comparison_is_a_guard():
    tape = Tape()
    b, s = tape.variable(1), tape.variable(128)
    value = (s * 3 if b == 1 else s * 5) + (b * s > 100)
    replay = compile_walk(tape, [Phase("x", {"v": value})])
    assert replay(1, 200)[0].total == 601
    assert replay(2, 200) is None  # batch != 1: another branch
    assert replay(1, 50) is None  # b * s <= 100: the comparison went the other way


def test_leaving_the_polynomials_pins_the_value():
    """range(), int() and formatting need the number itself: the record holds only there."""
    tape = Tape()
    b, s = tape.variable(2), tape.variable(30)
    chunks = len(range(0, s, 8)) * b
    replay = compile_walk(tape, [Phase(f"{s}", {"v": chunks})])
    assert replay(5, 30)[0].total == 20
    assert replay(2, 31) is None
