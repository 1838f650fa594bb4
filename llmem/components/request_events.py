"""The request stream's writer (`Requests`): one tensor a request, `(key, bytes, stream)`, keys numbered in the order
the requests are made. Decoder layers of one kind make the same requests: `Requests.layer` runs a layer's body once
per kind on symbolic keys (its own requests numbered from `_OWN`, the keys it is given replaced by `_GIVEN` + their
index) and writes every other layer of that kind from that record, its own keys shifted to where the stream has
reached and the given keys filled in: the same requests, in the same order, as running the body again
(tests/components/test_request_events.py, scripts/check_stream_identity.py). The op-by-op layers (TP, checkpointed)
and the one-GPU / DDP / ZeRO-1 layers are written so; FSDP2's and FSDP1's, a few bulk requests each (`allocs`), are
written directly: a record's copy costs about as much."""

from __future__ import annotations

from operator import itemgetter

_OWN = 1 << 28  # a recorded body's own keys: _OWN + 1, _OWN + 2, ... (below 2^30: CPython's one-digit ints)
_GIVEN = 1 << 29  # the keys it was given: _GIVEN + their index
_INT = {int}


class Stream(tuple):
    """A layout's stream, hashed once: the replays are kept keyed by the stream itself (layouts that write the same
    stream replay it once), and hashing some 20,000 events costs ~1 ms."""

    def __hash__(self) -> int:
        try:
            return self.__dict__["hash"]
        except KeyError:
            h = self.__dict__["hash"] = tuple.__hash__(self)
            return h


class Requests:
    """The stream in three columns, a request an index: `keys`, `sizes` (bytes, or a slot's name in a layout's
    stream; -1 frees the request `key`), `streams`; `events` the (key, bytes, stream) rows; `marks` (phase name,
    index of its first request). `repeat`: layers of one kind written from one record (`layer`); False runs every
    layer's body."""

    __slots__ = ("keys", "sizes", "streams", "marks", "_n", "_records")

    def __init__(self, repeat: bool = True) -> None:
        self.keys: list[int] = []
        self.sizes: list = []
        self.streams: list[int] = []
        self.marks: list[tuple[str, int]] = []
        self._n = 0
        self._records: dict | None = {} if repeat else None

    @property
    def events(self) -> list[tuple[int, int, int]]:
        return list(zip(self.keys, self.sizes, self.streams, strict=True))

    def columns(self) -> tuple[tuple, tuple, tuple]:
        return tuple(self.keys), tuple(self.sizes), tuple(self.streams)

    def mark(self, name: str) -> None:
        self.marks.append((name, len(self.keys)))

    def alloc(self, nbytes: int, stream: int = 0) -> int:
        self._n = n = self._n + 1
        if nbytes.__class__ is str or nbytes > 0:  # a str: a slot of a layout's stream (`_Skeleton`)
            self.keys.append(n)
            self.sizes.append(nbytes)
            self.streams.append(stream)
        return n

    def allocs(self, sizes: list, stream: int = 0) -> list[int]:
        """`[self.alloc(n, stream) for n in sizes]`, in one step."""
        n = self._n
        keys = list(range(n + 1, n + 1 + len(sizes)))
        self._n = n + len(sizes)
        if 0 not in sizes:  # every request made (bytes > 0, or a slot)
            self.keys += keys
            self.sizes += sizes
            self.streams += [stream] * len(sizes)
            return keys
        made = [(k, b) for k, b in zip(keys, sizes, strict=True) if b.__class__ is str or b > 0]
        self.keys += [k for k, _ in made]
        self.sizes += [b for _, b in made]
        self.streams += [stream] * len(made)
        return keys

    def free(self, *keys: int) -> None:
        self.keys += keys
        self.sizes += [-1] * len(keys)
        self.streams += [0] * len(keys)

    def layer(self, kind, body, given, *args):
        """`body(self, given, *args)`: a layer's requests, returning keys. `given`: the keys it reads (ints, in
        lists, tuples and dicts; 0 a request not made); `kind`: everything else its requests follow from (`args`
        besides the layer's index, itself no input but through `kind`). Layers of the same `kind` whose given keys
        have the same structure, zeros and repeats are written from the first one's record."""
        if self._records is None:
            return body(self, given, *args)
        seen: dict = {}
        symbolic = _symbolic(given, seen)
        key = (body, kind, repr(symbolic))  # its structure, names, zeros and repeats
        record = self._records.get(key)
        if record is None:
            record = self._records[key] = _record(body, symbolic, args, len(seen))
        own, sizes, streams, runs, literals, count, out = record
        base, keys = self._n, self.keys
        if base + count >= _OWN:
            raise ValueError("a stream of 2^28 requests")
        self._n = base + count
        start = len(keys)
        keys += map(base.__add__, own)
        values = [*seen, *literals]
        for a, b, pick in runs:
            keys[start + a:start + b] = pick(values)
        self.sizes += sizes
        self.streams += streams
        return _filled(out, base, values)  # (given keys first in `values`)


def _record(body, symbolic, args, given: int) -> tuple:
    """`body` run on symbolic keys: its requests' keys relative to the first (`own`; the others, given keys and keys
    it names itself (0), written over them in `runs` of consecutive requests (first, end, what picks them from the
    given keys followed by `literals`)), sizes and streams, how many keys it numbers, its returned keys."""
    rec = Requests(repeat=False)
    rec._n = _OWN
    out = body(rec, symbolic, *args)
    if rec.marks:
        raise ValueError("a layer's body marks no phase")
    own = [k - _OWN if _OWN < k < _GIVEN else 0 for k in rec.keys]
    literals: list = []
    picks: dict = {}  # request index -> index in the given keys and literals
    for i, k in enumerate(rec.keys):
        if k >= _GIVEN:
            picks[i] = k - _GIVEN
        elif k <= _OWN:
            picks[i] = given + len(literals)
            literals.append(k)
    runs = []
    for i in sorted(picks):
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
            runs[-1][2].append(picks[i])
        else:
            runs.append([i, i + 1, [picks[i]]])
    runs = [(a, b, itemgetter(*idx) if len(idx) > 1 else lambda v, j=idx[0]: (v[j],)) for a, b, idx in runs]
    return own, rec.sizes, rec.streams, runs, literals, rec._n - _OWN, _compiled(out)


class _Own:
    """A returned list or tuple of the body's own keys only: their offsets from the first, filled in one step."""

    __slots__ = ("offsets", "tuple")

    def __init__(self, keys, is_tuple: bool) -> None:
        self.offsets, self.tuple = [k - _OWN for k in keys], is_tuple


class _Dict:
    __slots__ = ("names", "values")

    def __init__(self, names: tuple, values) -> None:
        self.names, self.values = names, values


def _compiled(x):
    """A record's returned keys with each list or tuple of its own keys only an `_Own`, each dict a `_Dict`."""
    c = x.__class__
    if c is list or c is tuple:
        if x and all(v.__class__ is int and _OWN < v < _GIVEN for v in x):
            return _Own(x, c is tuple)
        out = [_compiled(v) for v in x]
        return out if c is list else tuple(out)
    if c is dict:
        return _Dict(tuple(x), _compiled(list(x.values())))
    return x


def _symbolic(x, seen: dict):
    """`x` with every key but 0 replaced by `_GIVEN` + its index in `seen` (a key given twice, one symbol)."""
    c = x.__class__
    if c is list or c is tuple:
        if x and set(map(type, x)) == _INT and 0 not in x and seen.keys().isdisjoint(x) and len(set(x)) == len(x):
            first = _GIVEN + len(seen)  # distinct keys, none 0 nor seen: the next symbols in turn
            out = list(range(first, first + len(x)))
            seen.update(zip(x, out, strict=True))
            return out if c is list else tuple(out)
        out = [(seen.setdefault(v, _GIVEN + len(seen)) if v else 0) if v.__class__ is int else _symbolic(v, seen)
               for v in x]
        return out if c is list else tuple(out)
    if c is dict:
        return dict(zip(x, _symbolic(list(x.values()), seen), strict=True))
    if c is int:
        return seen.setdefault(x, _GIVEN + len(seen)) if x else 0
    return x  # a name


def _filled(x, base: int, values: list):
    """A record's returned keys (`_compiled`) for the layer written: its own from `base` on, the given ones filled
    in."""
    c = x.__class__
    if c is _Own:
        out = list(map(base.__add__, x.offsets))
        return tuple(out) if x.tuple else out
    if c is _Dict:
        return dict(zip(x.names, _filled(x.values, base, values), strict=True))
    shift = base - _OWN
    if c is list or c is tuple:
        out = [(v if v <= _OWN else v + shift if v < _GIVEN else values[v - _GIVEN]) if v.__class__ is int else
               _filled(v, base, values) for v in x]
        return out if c is list else tuple(out)
    if c is int:
        return x if x <= _OWN else x + shift if x < _GIVEN else values[x - _GIVEN]
    return x


def layer_kinds(spec) -> tuple[int, ...]:
    """Each decoder layer's kind: layers whose parameters are the same but for the index (names, shapes, TP splits)
    have the same number, what a layer's requests follow from besides the plan."""
    return spec.memo(("request layer kinds",), lambda: _kinds(spec))


def _kinds(spec) -> tuple[int, ...]:
    numbers: dict = {}
    return tuple(numbers.setdefault(tuple((p.name.replace(f".{i}.", ".", 1), p.shape, p.tp_split)
                                          for p in spec.layer_params(i)), len(numbers))
                 for i in range(spec.num_layers))
