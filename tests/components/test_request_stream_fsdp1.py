"""FSDP1's request stream (llmem.components.request_stream_fsdp1) and the point program's replay
(llmem.components.request_stream_point): the streams FSDP1 allocates on, the point prefix against the allocator
model's own `empty_cache()`, and both programs' figures against simulate's replay of the fake-tensor run."""

import random

import pytest

from llmem.allocator import CachingAllocator
from llmem.allocator_replay import peak_reserved
from llmem.components import request_stream as rs
from llmem.components import request_stream_fsdp1 as fsdp1
from llmem.components.request_stream_point import point_reserved_bytes, without_build
from llmem.estimate import estimate
from llmem.plan import TrainingPlan
from llmem.presets import load_preset
from llmem.spec import ModelSpec, program_spec

MIXED = {"batch_size": 1, "seq_len": 1024, "precision": "bf16-mixed"}
FSDP1 = {"gpus": 8, "zero": 3, "engine": "fsdp1"}


def _spec(preset: str, plan: TrainingPlan) -> ModelSpec:
    return program_spec(ModelSpec.from_config(load_preset(preset)), plan)


def _emptied(events, marks) -> int:
    """`max_memory_reserved` after the reset, by the allocator model itself: every request through
    `CachingAllocator`, `empty_cache()` then `reset_peak()` at the first iteration's mark."""
    start = dict(marks)["forward 1"]
    alloc, live = CachingAllocator(), {}
    for i, (key, nbytes, stream) in enumerate(events):
        if i == start:
            alloc.empty_cache()
            alloc.reset_peak()
        if nbytes > 0:
            live[key] = alloc.malloc(nbytes, stream)
        else:
            alloc.free(live.pop(key, None))
    return alloc.peak_reserved


def _columns(events: list) -> tuple:
    """Events (key, bytes, stream) as the columns a layout's stream is kept in (`Requests.columns`)."""
    return tuple(tuple(c) for c in zip(*events, strict=True))


@pytest.mark.parametrize("plan", [{}, {"gpus": 4, "zero": 1}, {"gpus": 8, "zero": 3}, {"gpus": 2, "tp": 2},
                                  FSDP1, {**FSDP1, "precision": "bf16", "grad_ckpt": "full"}])
def test_the_point_prefix_leaves_what_empty_cache_leaves(plan):
    """The point program's stream (`without_build`: the build and wrap replaced by a prefix that lays out the kept
    segments again) replayed by the flat loop gives, to the byte, what the allocator model gives for the plan's own
    stream with `empty_cache()` at the first iteration."""
    p = TrainingPlan(**(MIXED | plan))
    spec = _spec("qwen2.5-0.5b", p)
    req = rs.program_requests(spec, p)
    point = without_build(_columns(req.events), dict(req.marks)["forward 1"])
    assert peak_reserved(list(zip(*point, strict=True))) == _emptied(req.events, req.marks)
    assert point_reserved_bytes(spec, p) == _emptied(req.events, req.marks)


@pytest.mark.parametrize("seed", range(20))
def test_the_point_prefix_on_random_streams(seed):
    """Random prefixes (small and large requests, on two streams, some freed) then random iterations: the same
    figure as the allocator model's `empty_cache()` at the mark."""
    rng = random.Random(seed)
    events, live, marks = [], [], []
    for n in range(400):
        if n == 200:
            marks.append(("forward 1", len(events)))
        if live and rng.random() < 0.4:
            events.append((live.pop(rng.randrange(len(live))), -1, 0))
            continue
        size = rng.choice([rng.randint(1, 1 << 20), rng.randint(1 << 20, 10 << 20), rng.randint(10 << 20, 80 << 20)])
        events.append((n, size, rng.choice([0, 0, 1])))
        live.append(n)
    point = without_build(_columns(events), dict(marks)["forward 1"])
    assert peak_reserved(list(zip(*point, strict=True))) == _emptied(events, marks)


def test_fsdp1_streams_follow_its_program():
    """Stream 1 (`_unshard_stream`): one padded unsharded flat parameter per unshard — the root once and each layer
    twice (forward, backward) per iteration; stream 3 (`_pre_unshard_stream`): the `_mp_shard` beside each under
    MixedPrecision; stream 2 (`_post_backward_stream`): per unit and iteration the bf16 sharded gradient and its fp32
    cast. After two iterations only the fp32 shards and AdamW's two states per stepped tensor are live."""
    p = TrainingPlan(**MIXED, **FSDP1)
    spec = _spec("qwen2.5-0.5b", p)
    req = rs.program_requests(spec, p)
    allocs = [(n, s) for _, n, s in req.events if n > 0]
    units = spec.num_layers + 1
    unshards = 2 * (1 + 2 * spec.num_layers)
    assert sum(s == fsdp1.UNSHARD for _, s in allocs) == unshards
    assert sum(s == fsdp1.PRE_UNSHARD for _, s in allocs) == unshards
    assert sum(s == fsdp1.POST_BACKWARD for _, s in allocs) == 2 * 2 * units
    wrapped, end = _live_bytes(req.events[:dict(req.marks)["forward 1"]]), _live_bytes(req.events)
    padding = (len(spec.params) + units) * 8  # alignment to 16 bytes of bf16 per tensor, and to 8 ranks per unit
    assert spec.total_params * 4 / 8 <= wrapped <= (spec.total_params + padding) * 4 / 8  # the fp32 shards
    assert 2 * 0.99 * wrapped <= end - wrapped <= 2 * wrapped  # exp_avg, exp_avg_sq of rank 0's part of each tensor
    assert not fsdp1.applies(p.with_(method="lora")) and not fsdp1.applies(p.with_(gpus=1, zero=0))
    assert rs.replays(spec, p)


def _live_bytes(events) -> int:
    live: dict = {}
    for key, nbytes, _ in events:
        if nbytes > 0:
            live[key] = nbytes
        else:
            live.pop(key, None)
    return sum(live.values())


@pytest.mark.heavy
@pytest.mark.parametrize("plan", [FSDP1, {**FSDP1, "gpus": 4, "precision": "bf16", "grad_ckpt": "full"}])
def test_fsdp1_reserved_against_simulate(plan):
    """qwen2.5-0.5b, 1 × 1024: both programs' figures within 3 % of simulate's replay of the fake-tensor run (every
    aten allocation of the real FullyShardedDataParallel, each on its stream, through the same allocator model):
    built in full on the device (`reserved_bytes`), and the point figure with the cache emptied after wrapping
    (`reserved_emptied_bytes`)."""
    from llmem.simulate import simulate

    p = TrainingPlan(**(MIXED | plan))
    sim = simulate(load_preset("qwen2.5-0.5b"), p)
    spec = _spec("qwen2.5-0.5b", p)
    built = rs.replayed_reserved_bytes(spec, p)
    point = estimate(ModelSpec.from_config(load_preset("qwen2.5-0.5b")), p).reserved_bytes
    assert abs(built - sim.reserved_bytes) <= 0.03 * sim.reserved_bytes, (built / 2**30, sim.reserved_bytes / 2**30)
    assert abs(point - sim.reserved_emptied_bytes) <= 0.03 * sim.reserved_emptied_bytes, \
        (point / 2**30, sim.reserved_emptied_bytes / 2**30)
