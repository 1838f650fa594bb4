"""The flat replay loop (llmem/allocator_replay.py) against the allocator model it restates (llmem/allocator.py, an
object per block, whose rules tests/test_allocator.py checks one by one): the same reserved bytes to the byte on
random streams that exercise every rule of the default setting (both pools, split and whole hand-outs, merges on
either side, several streams, frees of unknown keys), on layered streams whose sizes are named slots (each distinct
request resolved once per replay and stream, `_resolver`: a slot filled in wrong, of 0 bytes or shared by two streams
would show), and on the estimate's own request streams."""

from __future__ import annotations

import random

import pytest

from llmem.allocator import CachingAllocator
from llmem.allocator_replay import peak_reserved
from llmem.components import request_stream as rs
from llmem.plan import TrainingPlan
from llmem.presets import load_preset
from llmem.spec import ModelSpec


def _object_model(events) -> int:
    alloc, blocks = CachingAllocator(), {}
    for key, nbytes, stream in events:
        if nbytes > 0:
            blocks[key] = alloc.malloc(nbytes, stream)
        else:
            alloc.free(blocks.pop(key, None))
    return alloc.peak_reserved


SIZES = (1, 511, 512, 513, 4096, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, 3 << 20, (10 << 20) - 7, 10 << 20,
         (21 << 20) + 5, 64 << 20, 200 << 20)


def _random_stream(rng: random.Random, n: int) -> list[tuple[int, int, int]]:
    events, live = [], []
    for key in range(1, n + 1):
        if live and rng.random() < 0.45:
            events.append((live.pop(rng.randrange(len(live))), -1, 0))
        elif rng.random() < 0.02:
            events.append((n + key, -1, 0))  # a key never allocated
        size = rng.choice(SIZES) if rng.random() < 0.6 else rng.randrange(1, 80 << 20)
        events.append((key, size, rng.choice((0, 0, 0, 1))))
        live.append(key)
    return events


@pytest.mark.parametrize("seed", range(6))
def test_random_streams_reserve_the_same_bytes(seed):
    rng = random.Random(seed)
    events = _random_stream(rng, 3000)
    assert peak_reserved(events) == _object_model(events)


@pytest.mark.parametrize("model,fields", [
    ("qwen2.5-0.5b", {"precision": "bf16-mixed"}),
    ("llama-3.2-1b", {"gpus": 8, "zero": 1, "precision": "fp32"}),
    ("qwen3-4b", {"gpus": 8, "precision": "bf16"}),
    ("qwen2.5-1.5b", {"gpus": 2, "tp": 2, "precision": "bf16-mixed"}),
])
def test_program_streams_reserve_the_same_bytes(model, fields):
    spec = ModelSpec.from_config(load_preset(model))
    events = rs.program_requests(spec, TrainingPlan(batch_size=2, seq_len=1024, **fields)).events
    assert peak_reserved(events) == _object_model(events)


def _layered_stream(rng: random.Random, layers: int) -> tuple[list, dict]:
    """A program's shape: a build, then per layer the same requests (some named slots, some of 0 bytes: not made),
    held to a backward that frees them last layer first between gradient requests; the slots' sizes drawn."""
    slots = {f"s{i}": rng.choice((0, rng.choice(SIZES), rng.randrange(1, 80 << 20))) for i in range(6)}
    layer = [rng.choice((*slots, *SIZES)) for _ in range(rng.randrange(3, 9))]
    temp = rng.choice((*slots, *SIZES))
    events, key, kept = [], 0, []
    for _ in range(rng.randrange(1, 20)):  # build
        key += 1
        events.append((key, rng.choice(SIZES), 0))
    for _ in range(layers):
        held = []
        for n in layer:
            key += 1
            events.append((key, n, rng.choice((0, 0, 1)) if n == temp else 0))
            held.append(key)
        key += 1
        events += [(key, temp, 0), (key, -1, 0)]  # a temporary freed at once
        kept.append(held)
    for held in reversed(kept):
        key += 1
        events.append((key, rng.choice(SIZES), 0))  # a gradient, kept
        events += [(k, -1, 0) for k in reversed(held)]
    return events, slots


@pytest.mark.parametrize("seed", range(8))
def test_layered_slotted_streams_reserve_the_same_bytes(seed):
    rng = random.Random(f"layered:{seed}")
    events, slots = _layered_stream(rng, rng.randrange(2, 40))
    filled = [(k, slots.get(n, n), st) for k, n, st in events]
    expected = _object_model([e for e in filled if e[1] != 0])
    assert peak_reserved(events, slots) == expected
    assert peak_reserved(filled) == expected
