"""A whole number that remembers how it was computed from the micro-batch and the sequence length (`Sym`), and the
record of one computation with them (`Tape`): the walk run once on symbols instead of numbers (`llmem.walk.replay`)
says every size as a polynomial in (batch, seq_len) with integer coefficients, and every decision it took on them.

A `Sym` carries its number (`value`, computed exactly as the plain int would be) and its polynomial (`poly`: a dict
from a monomial — a sorted tuple of atom indices, () the constant — to its coefficient). +, -, * and ** keep a
polynomial; a floor division whose coefficients all divide is exact and stays one; any other // or % becomes a new
atom (its two operands' polynomials, evaluated again at replay). A comparison, `bool`, or any use as a plain number
(`int`, `range`, formatting, hashing into nothing) records a guard on the tape: the sign the difference had, or the
exact value; a replay whose guards do not all hold again is refused and the walk runs for real. A result whose
polynomial is constant is returned as a plain int."""

from __future__ import annotations

import operator

ONE = ()  # the constant monomial
_TESTS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq,
          "!=": operator.ne}
NEGATED = {"<": ">=", "<=": ">", ">": "<=", ">=": "<", "==": "!=", "!=": "=="}


class Tape:
    """The atoms (the variables and the opaque divisions, in creation order) and the guards, interleaved in `steps`
    as they happened: ("atom", index) or ("guard", poly, test), `test` what held of the polynomial: "< 0", ">= 0",
    "== 0", ... (`NEGATED` the test that fails it)."""

    def __init__(self) -> None:
        self.atoms: list[tuple] = []  # (op, left poly, right poly); op "var" for a variable
        self.values: list[int] = []
        self.steps: list[tuple] = []
        self._interned: dict = {}

    def variable(self, value: int) -> Sym:
        return self._atom(("var", len(self.atoms), None), value)

    def _atom(self, key: tuple, value: int) -> Sym:
        index = self._interned.get(key)
        if index is None:
            index = self._interned[key] = len(self.atoms)
            self.atoms.append(key)
            self.values.append(value)
            self.steps.append(("atom", index))
        return Sym(self, {(index,): 1}, value)

    def opaque(self, op: str, left, right, value: int):
        return self._atom((op, _frozen(left), _frozen(right)), value)

    def guard(self, poly: dict, test: str) -> None:
        """`poly test 0` held and must hold at replay; nothing to keep when `poly` is constant."""
        if any(mono != ONE for mono in poly):
            self.steps.append(("guard", _frozen(poly), test))


def _frozen(poly) -> tuple:
    return tuple(sorted(poly.items())) if isinstance(poly, dict) else ((ONE, poly),)


def _poly(x) -> dict | None:
    """`x`'s polynomial: a Sym's own, a plain int's constant, None for anything else (a float, a Fraction)."""
    if isinstance(x, Sym):
        return x.poly
    if isinstance(x, int):
        return {ONE: int(x)} if x else {}
    return None


def _add(a: dict, b: dict, sign: int = 1) -> dict:
    out = dict(a)
    for mono, coef in b.items():
        c = out.get(mono, 0) + sign * coef
        if c:
            out[mono] = c
        else:
            out.pop(mono, None)
    return out


def _mul(a: dict, b: dict) -> dict:
    out: dict = {}
    for ma, ca in a.items():
        for mb, cb in b.items():
            mono = tuple(sorted(ma + mb))
            c = out.get(mono, 0) + ca * cb
            if c:
                out[mono] = c
            else:
                out.pop(mono, None)
    return out


class Sym:
    """A whole number and its polynomial in the tape's atoms (module docstring)."""

    __slots__ = ("poly", "tape", "value")

    def __init__(self, tape: Tape, poly: dict, value: int) -> None:
        self.tape, self.poly, self.value = tape, poly, value

    def _make(self, poly: dict, value: int):
        return Sym(self.tape, poly, value) if any(mono != ONE for mono in poly) else value

    def concrete(self) -> int:
        """The number, with a guard that it is exactly this number (what leaves the polynomial world)."""
        self.tape.guard(_add(self.poly, {ONE: self.value}, -1), "==")
        return self.value

    def _compare(self, other, op: str):
        """`self op other` (op "<", "==", ...), the outcome guarded (against anything but a whole number: the number
        itself)."""
        p = _poly(other)
        if p is None:
            return _TESTS[op](self.concrete(), other)
        holds = _TESTS[op](self.value - _value(other), 0)
        self.tape.guard(_add(self.poly, p, -1), op if holds else NEGATED[op])
        return holds

    def __add__(self, other):
        p = _poly(other)
        if p is None:
            return self.concrete() + other
        return self._make(_add(self.poly, p), self.value + _value(other))

    __radd__ = __add__

    def __sub__(self, other):
        p = _poly(other)
        if p is None:
            return self.concrete() - other
        return self._make(_add(self.poly, p, -1), self.value - _value(other))

    def __rsub__(self, other):
        p = _poly(other)
        if p is None:
            return other - self.concrete()
        return self._make(_add(p, self.poly, -1), _value(other) - self.value)

    def __mul__(self, other):
        p = _poly(other)
        if p is None:
            return self.concrete() * other
        return self._make(_mul(self.poly, p), self.value * _value(other))

    __rmul__ = __mul__

    def __neg__(self):
        return self._make({m: -c for m, c in self.poly.items()}, -self.value)

    def __pos__(self):
        return self

    def __abs__(self):
        return -self if self._compare(0, "<") else self

    def __pow__(self, exponent):
        if type(exponent) is not int or exponent < 0:
            return self.concrete() ** exponent
        out = 1
        for _ in range(exponent):
            out = out * self
        return out

    def __floordiv__(self, other):
        p = _poly(other)
        if p is None:
            return self.concrete() // other
        value = self.value // _value(other)
        if type(other) is int and other and all(c % other == 0 for c in self.poly.values()):
            return self._make({m: c // other for m, c in self.poly.items()}, value)
        return self.tape.opaque("//", self.poly, p, value)

    def __rfloordiv__(self, other):
        p = _poly(other)
        if p is None:
            return other // self.concrete()
        return self.tape.opaque("//", p, self.poly, _value(other) // self.value)

    def __mod__(self, other):
        p = _poly(other)
        if p is None:
            return self.concrete() % other
        return self.tape.opaque("%", self.poly, p, self.value % _value(other))

    def __rmod__(self, other):
        p = _poly(other)
        if p is None:
            return other % self.concrete()
        return self.tape.opaque("%", p, self.poly, _value(other) % self.value)

    def __divmod__(self, other):
        return self // other, self % other

    def __lt__(self, other):
        return self._compare(other, "<")

    def __le__(self, other):
        return self._compare(other, "<=")

    def __gt__(self, other):
        return self._compare(other, ">")

    def __ge__(self, other):
        return self._compare(other, ">=")

    def __eq__(self, other):
        return self._compare(other, "==")

    def __ne__(self, other):
        return self._compare(other, "!=")

    __hash__ = object.__hash__  # a Sym in a memo key is a key of its own (a miss, computed again, never wrong)

    def __bool__(self) -> bool:
        return self._compare(0, "!=")

    def bit_length(self) -> int:
        """int.bit_length, guarded by the power-of-two bounds it reads: 2**(k-1) <= self < 2**k."""
        k = self.value.bit_length()
        if self.value <= 0:
            return self.concrete().bit_length()
        self._compare(1 << (k - 1), ">=")
        self._compare(1 << k, "<")
        return k

    def __index__(self) -> int:
        return self.concrete()

    __int__ = __index__

    def __float__(self) -> float:
        return float(self.concrete())

    def __truediv__(self, other):
        return self.concrete() / other

    def __rtruediv__(self, other):
        return other / self.concrete()

    def __ceil__(self):
        return self

    __floor__ = __trunc__ = __ceil__

    def __round__(self, ndigits=None):
        return self if ndigits is None or ndigits >= 0 else round(self.concrete(), ndigits)

    def __format__(self, spec: str) -> str:
        return format(self.concrete(), spec)

    def __repr__(self) -> str:
        return repr(self.concrete())

    __str__ = __repr__


def _value(x) -> int:
    return x.value if isinstance(x, Sym) else int(x)
