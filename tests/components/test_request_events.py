"""The request stream's writer (llmem.components.request_events): layers of one kind written from one record
(`Requests.layer`) give the same requests, in the same order, as running every layer's body (`repeat=False`), over
the schemes, precisions and checkpointing the stream writes out, at a plan's sizes and as a layout's slots, and for a
model whose layers are not all of one kind."""

import dataclasses
import itertools

import pytest

from llmem.components import request_stream as rs
from llmem.components.request_events import Requests, layer_kinds
from llmem.errors import InputError
from llmem.plan import TrainingPlan
from llmem.presets import load_preset
from llmem.spec import ModelSpec

SCHEMES = ({}, {"gpus": 4}, {"gpus": 4, "zero": 1}, {"gpus": 4, "zero": 2}, {"gpus": 4, "zero": 3},
           {"gpus": 2, "tp": 2}, {"gpus": 8, "tp": 2, "zero": 3}, {"gpus": 4, "zero": 3, "engine": "fsdp1"})
CKPT = ({}, {"grad_ckpt": "full"}, {"grad_ckpt": "full", "ckpt_every": 3}, {"grad_ckpt": "selective"})
PRECISIONS = ("fp32", "bf16", "bf16-mixed")


def _both(spec: ModelSpec, plan: TrainingPlan, skeleton: bool) -> tuple[Requests, Requests]:
    def write(repeat: bool) -> Requests:
        sizes = None
        if skeleton:
            s = rs._PlanSizes(spec, plan)
            sizes = rs._Skeleton(len(s.table), s.upcast, tuple(s.names), *rs.ckpt_ops.policy_sizes(spec, plan, None))
        return rs.program_requests(spec, plan, sizes, repeat=repeat)
    return write(True), write(False)


def _plans() -> list:
    out = []
    for scheme, ckpt, precision in itertools.product(SCHEMES, CKPT, PRECISIONS):
        try:
            plan = TrainingPlan(**scheme, **ckpt, precision=precision, batch_size=2, seq_len=300)
        except InputError:  # selective under TP
            continue
        out.append(pytest.param(plan, id=f"{scheme}-{ckpt}-{precision}"))
    return out


@pytest.mark.parametrize("preset", ["qwen2.5-0.5b", "qwen3-0.6b"])
@pytest.mark.parametrize("plan", _plans())
def test_layers_written_from_records_are_the_layers_written_one_by_one(preset, plan):
    """Every request (key, bytes, stream) and phase mark the same, at the plan's sizes and as slots; qwen2.5 (biases,
    tied), qwen3 (q/k norms); `ckpt_every` 3 alternates checkpointed and plain layers, FSDP prefetches the next
    layer's all-gather but at the first."""
    spec = ModelSpec.from_config(load_preset(preset))
    if not rs.covers(spec, plan):
        pytest.skip("a plan the stream does not write out")
    for skeleton in (False, True):
        fast, slow = _both(spec, plan, skeleton)
        assert fast.marks == slow.marks
        assert fast.events == slow.events


def _mixed(spec: ModelSpec, layer: int) -> ModelSpec:
    """`spec` with decoder layer `layer`'s MLP twice as wide: a layer of another kind."""
    def widen(p):
        if p.layer != layer or ".mlp." not in p.name:
            return p
        shape = (p.shape[0] * 2, p.shape[1]) if "down_proj" not in p.name else (p.shape[0], p.shape[1] * 2)
        return dataclasses.replace(p, shape=shape)
    return dataclasses.replace(spec, params=tuple(widen(p) for p in spec.params))


@pytest.mark.parametrize("fields", [{}, {"gpus": 4, "zero": 3}, {"gpus": 4, "zero": 2}, {"gpus": 2, "tp": 2},
                                    {"grad_ckpt": "full"}, {"gpus": 4, "zero": 3, "engine": "fsdp1"}])
def test_a_layer_of_another_kind_gets_its_own_record(fields):
    """A model whose layer 5 is wider than the others: its kind differs (`layer_kinds`), its requests (weight copies,
    gradients, shards, the all-gather prefetched before it) are its own, and the stream is the one written layer by
    layer."""
    spec = _mixed(ModelSpec.from_config(load_preset("qwen2.5-0.5b")), 5)
    assert layer_kinds(spec)[5] != layer_kinds(spec)[4] == layer_kinds(spec)[6]
    plan = TrainingPlan(**fields, precision="bf16-mixed", batch_size=1, seq_len=256)
    fast, slow = _both(spec, plan, False)
    assert fast.events == slow.events


def test_a_record_is_kept_per_structure_zeros_and_repeats_of_the_keys_given():
    """A toy body: frees what it is given, allocates one request per given key and returns them with the given;
    calls with a 0 (a request not made) or a key given twice are not written from the record of distinct keys."""
    def body(req, given, nbytes):
        a, b = given
        req.free(a, b)
        return [req.alloc(nbytes) for _ in (a, b)] + [a, b]

    def run(repeat: bool) -> tuple:
        req = Requests(repeat)
        keys = req.allocs([512, 1024, 2048])
        outs = [req.layer("toy", body, given, 4096) for given in
                ((keys[0], keys[1]), (keys[2], 0), (keys[1], keys[1]), (keys[2], keys[0]))]
        return req.events, outs, req._n

    assert run(True) == run(False)
    req = Requests()
    k = req.allocs([512, 512])
    req.layer("toy", body, (k[0], k[1]), 4096)
    req.layer("toy", body, (k[1], k[0]), 4096)
    req.layer("toy", body, (k[0], 0), 4096)
    assert len(req._records) == 2  # distinct keys, and one of them 0
