"""The walk of a plan whose micro-batch or sequence length is new, without walking: every other field (the plan's
`layout_key`) fixes which moments the walk visits and which tensors each holds; only their sizes read (batch,
seq_len), as polynomials with integer coefficients (`llmem.symbolic`).

The second time a layout is walked at a new (batch, seq_len), the walk runs once more on symbols (`Tape`,
`Sym`): its moments come out as polynomials, with the decisions it took on batch and seq_len as guards (`batch ==
1`, a comparison with a sliding window, a chunk count...). That record is compiled into one Python function
(`compile_walk`: the guards, then every moment's bytes per category as a sum of monomials; moments with equal
breakdowns share one dict, as nothing mutates a Phase) and kept on the spec per
layout. A later plan of that layout evaluates it: the same `Phase`s as the walk, to the byte, when every guard holds
(checked at the traced point against the walk itself before it is kept); else the walk runs, and may be traced
again (at most `MAX_TRACES` per layout). Nothing here changes a number: it only skips recomputing the structure."""

from __future__ import annotations

import itertools
from dataclasses import fields

from llmem.symbolic import NEGATED, ONE, Sym, Tape
from llmem.walk.phase import Phase

MAX_TRACES = 6  # compiled records kept per layout (regimes: a batch of one, a sliding window, ...)
TRACE_AFTER = 2  # walks of a layout before it is traced (a plan asked once is walked only)
_TRACE_KEYS = itertools.count(-1, -1)  # a traced plan's key: negative, never a plan's (`plan.field_key`)
# in this process: plans answered by a record, walked, traces made and kept, the reasons a trace was not kept
STATS: dict = {"replayed": 0, "walked": 0, "traced": 0, "kept": 0, "failures": {}}


class Replays:
    """A layout's compiled walks, the walks done without one, and why the last trace was not kept."""

    def __init__(self) -> None:
        self.compiled: list = []
        self.walks = 0
        self.traces = 0
        self.failure = ""

    def find(self, batch: int, seq_len: int) -> tuple[Phase, ...] | None:
        for replay in self.compiled:
            try:
                phases = replay(batch, seq_len)
            except ZeroDivisionError:  # a divisor that was not zero at the traced point (no guard on it)
                continue
            if phases is not None:
                return phases
        return None

    def learn(self, spec, plan, walk, phases: tuple[Phase, ...]) -> None:
        """After a walk: trace the layout when it has been walked `TRACE_AFTER` times, and keep the record when it
        gives the walk's phases back exactly at this plan."""
        self.walks += 1
        if self.walks < TRACE_AFTER or self.traces >= MAX_TRACES:
            return
        self.traces += 1
        STATS["traced"] += 1
        try:
            replay = compile_walk(*trace(spec, plan, walk))
            again = replay(plan.batch_size, plan.seq_len)
        except (TypeError, ValueError, AttributeError, ZeroDivisionError) as e:  # an operation Sym does not model
            self.failure = f"{type(e).__name__}: {e}"
            STATS["failures"][self.failure] = STATS["failures"].get(self.failure, 0) + 1
            return
        if again is None or not same_phases(again, phases):
            self.failure = "the record differs from the walk at the traced point"
            STATS["failures"][self.failure] = STATS["failures"].get(self.failure, 0) + 1
            return
        STATS["kept"] += 1
        self.compiled.append(replay)


def walked(spec, plan, walk) -> tuple[Phase, ...]:
    """`walk(spec, plan)`'s phases: from a compiled record of the plan's layout when one holds, else walked. Walked
    phases are kept on the spec per plan (a plan asked again is not walked again); replayed ones are not: evaluating
    the record again costs about what the estimate's other terms do, and keeping every plan's phases alive would
    leave the cyclic garbage collector ~2 objects per moment to traverse again at each collection (a DeepSpeed
    ZeRO-3 walk has 177 moments)."""
    if type(plan.batch_size) is Sym or type(plan.seq_len) is Sym:  # inside a trace: walk on symbols
        return tuple(walk(spec, plan))
    replays = spec.memo(("replays", plan.layout_key), Replays)
    phases = replays.find(plan.batch_size, plan.seq_len)
    if phases is None:
        phases = spec.memo(("phases", plan.key), lambda: _walk(spec, plan, walk, replays), per_plan=True)
    else:
        STATS["replayed"] += 1
    return phases


def _walk(spec, plan, walk, replays: Replays) -> tuple[Phase, ...]:
    STATS["walked"] += 1
    phases = tuple(walk(spec, plan))
    replays.learn(spec, plan, walk, phases)
    return phases


def trace(spec, plan, walk) -> tuple[Tape, list[Phase]]:
    """The walk of `plan` with its batch and sequence length replaced by symbols (atoms 0 and 1 of the tape)."""
    tape = Tape()
    symbolic = object.__new__(type(plan))
    symbolic.__dict__.update({f.name: getattr(plan, f.name) for f in fields(plan)})
    symbolic.__dict__.update(batch_size=tape.variable(plan.batch_size), seq_len=tape.variable(plan.seq_len),
                             key=next(_TRACE_KEYS), layout_key=plan.layout_key)
    return tape, list(walk(spec, symbolic))


def same_phases(a, b) -> bool:
    """Equal names, breakdowns (in the same order) and totals."""
    return len(a) == len(b) and all(
        p.name == q.name and p.total == q.total and list(p.breakdown.items()) == list(q.breakdown.items())
        for p, q in zip(a, b, strict=True))


def compile_walk(tape: Tape, phases: list[Phase]):
    """One function (batch, seq_len) -> the phases, or None when a guard fails: the tape's steps in order (each
    opaque division an assignment, each guard a test), then the phases with their sizes as sums of monomials."""
    source = _Source(tape)
    for step in tape.steps:
        source.step(step)
    rows, breakdowns = [], {}  # equal breakdowns (a layer's moment repeated per layer) built once, shared
    for i, phase in enumerate(phases):
        source.names[f"N{i}"] = phase.name
        items = ", ".join(f"{source.category(c)}: {source.value(v)}" for c, v in phase.breakdown.items())
        if items not in breakdowns:
            breakdowns[items] = f"d{len(breakdowns)}"
            source.lines.append(f"{breakdowns[items]} = {{{items}}}")
        rows.append(f"new(Phase, (N{i}, {breakdowns[items]}, {source.value(phase.total)})),")
    body = "\n    ".join([*source.lines, "return (", *rows, ")"])
    namespace = {"Phase": Phase, "new": tuple.__new__, **source.names}
    exec(f"def replay(a0, a1):\n    {body}\n", namespace)  # noqa: S102 - code made here from integers and names
    return namespace["replay"]


class _Source:
    """The lines of a compiled walk: atoms `a<i>`, monomials `m_<i>_<j>...` defined once before their first use,
    names and categories passed in by name."""

    def __init__(self, tape: Tape) -> None:
        self.tape = tape
        self.lines: list[str] = []
        self.names: dict = {}
        self._categories: dict = {}
        self._monomials: set = set()
        self._guards: set = set()

    def step(self, step: tuple) -> None:
        if step[0] == "atom":
            op, left, right = self.tape.atoms[step[1]]
            if op != "var":
                self.lines.append(f"a{step[1]} = ({self.poly(left)}) {op} ({self.poly(right)})")
            return
        _, poly, test = step
        if (poly, test) not in self._guards:
            self._guards.add((poly, test))
            self.lines.append(f"if {self.poly(poly)} {NEGATED[test]} 0: return None")

    def value(self, v) -> str:
        if type(v) is Sym:
            if v.tape is not self.tape:
                raise ValueError("a size from another trace")
            return self.poly(tuple(v.poly.items()))
        if type(v) is not int:
            raise TypeError(f"a size that is not a whole number: {type(v).__name__}")
        return repr(v)

    def poly(self, poly: tuple) -> str:
        terms = [repr(c) if m == ONE else f"{c}*{self.monomial(m)}" for m, c in poly]
        return " + ".join(terms) or "0"

    def monomial(self, mono: tuple) -> str:
        if len(mono) == 1:
            return f"a{mono[0]}"
        name = "m_" + "_".join(map(str, mono))
        if mono not in self._monomials:
            self._monomials.add(mono)
            self.lines.append(f"{name} = {self.monomial(mono[:-1])} * a{mono[-1]}")
        return name

    def category(self, category) -> str:
        if category not in self._categories:
            self._categories[category] = name = f"K{len(self._categories)}"
            self.names[name] = category
        return self._categories[category]
