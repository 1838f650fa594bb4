"""FSDP2's request stream (llmem.components.request_stream_fsdp): its shards against torch's own chunking, its
side-stream requests against FSDP2's program (one all-gather per group and unshard, one reduce-scatter output per
group and backward), and its figure against simulate's replay of the fake-tensor run."""

import pytest

from llmem.components import request_stream as rs
from llmem.components import request_stream_fsdp as fsdp
from llmem.estimate import estimate
from llmem.plan import TrainingPlan
from llmem.presets import load_preset
from llmem.spec import ModelSpec, program_spec

MIXED = {"batch_size": 1, "seq_len": 1024, "precision": "bf16-mixed"}


def _spec(preset: str, plan: TrainingPlan) -> ModelSpec:
    return program_spec(ModelSpec.from_config(load_preset(preset)), plan)


def _live(events, stop=None) -> dict:
    live: dict = {}
    for key, nbytes, stream in events[:stop]:
        if nbytes > 0:
            live[key] = (nbytes, stream)
        else:
            assert live.pop(key, None) is not None or key == 0, key  # 0: a request not made (`Requests.alloc`)
    return live


def _torch_shard_bytes(spec: ModelSpec, dp: int) -> int:
    """FSDP2's `FSDPParam._init_sharded_param`: `torch.chunk(tensor, dp, dim=0)`, every rank's shard padded to the
    first chunk's size; fp32."""
    torch = pytest.importorskip("torch")
    total = 0
    for p in spec.params:
        first = torch.chunk(torch.empty(p.shape, device="meta"), dp, dim=0)[0]
        total += first.numel() * 4
    return total


@pytest.mark.parametrize("plan", [{"gpus": 8, "zero": 3}, {"gpus": 8, "zero": 2},
                                  {"gpus": 4, "zero": 3, "grad_ckpt": "full"}])
def test_only_the_shards_and_their_states_outlive_the_program(plan):
    """After the wrap the parameters are their padded dim-0 shards (as torch's own `torch.chunk` cuts them); after
    two iterations only those and AdamW's two states per shard are live: every other request is freed once."""
    p = TrainingPlan(**MIXED, **plan)
    spec = _spec("qwen2.5-0.5b", p)
    req = rs.program_requests(spec, p)
    shards = _torch_shard_bytes(spec, p.dp)
    wrapped = _live(req.events, dict(req.marks)["forward 1"])
    assert sum(n for n, _ in wrapped.values()) == shards
    assert sum(n for n, _ in _live(req.events).values()) == 3 * shards


@pytest.mark.parametrize("zero", [2, 3])
def test_side_stream_requests_follow_fsdp2s_program(zero):
    """Stream 1 (all_gather_copy_in_stream): per unshard the bf16 input copy and the output, the input freed at
    once — the root and every layer in forward, and under ZeRO-3 (`reshard_after_forward`) again in backward.
    Stream 2 (reduce_scatter_stream): one fp32 output per group and backward, 1/dp of the group's padded
    gradients, alive until `zero_grad`. Nothing else is on a side stream."""
    p = TrainingPlan(gpus=8, zero=zero, **MIXED)
    spec = _spec("qwen2.5-0.5b", p)
    groups = spec.num_layers + 1
    req = rs.program_requests(spec, p)
    allocs = [(n, s) for _, n, s in req.events if n > 0]
    unshards = 2 * groups * (2 if zero == 3 else 1)  # two iterations
    assert sum(s == fsdp.GATHER for _, s in allocs) == 2 * unshards
    outs = [n for n, s in allocs if s == fsdp.REDUCE]
    assert len(outs) == 2 * groups
    assert sum(outs[:groups]) == _torch_shard_bytes(spec, 8)  # fp32 reduce dtype: the shards' bytes
    assert {s for _, s in allocs} == {0, fsdp.GATHER, fsdp.REDUCE}


def test_fsdp2_plans_replay_and_their_outliers_keep_the_rules():
    """ZeRO-2, ZeRO-3 (checkpointed too, full or selective), TP × FSDP2 and dim1-if-short where no tensor is short
    replay; LoRA and eager attention keep the rules."""
    base = TrainingPlan(gpus=8, zero=3, **MIXED)
    for p in (base, base.with_(zero=2), base.with_(grad_ckpt="full"), base.with_(tp=2),
              base.with_(fsdp_shard="dim1-if-short"), base.with_(grad_ckpt="selective")):
        assert rs.replays(_spec("qwen2.5-0.5b", p), p), p
    for p in (base.with_(method="lora"), base.with_(attn="eager")):
        assert not rs.replays(_spec("qwen2.5-0.5b", p), p), p
    est = estimate(_spec("qwen2.5-0.5b", base), base)
    assert est.reserved_bytes_range[1] == max(est.reserved_bytes, rs.replayed_reserved_bytes(est.spec, base))


@pytest.mark.parametrize("gpus", [4])
def test_dim1_if_short_shards_a_dense_model_on_dim0(gpus):
    """`--fsdp-shard dim1-if-short` against the runtime's own placement function (`_dim1_if_short`, what it passes
    to `fully_shard(shard_placement_fn=...)`) over every parameter (the model's shapes: checked against
    transformers' in tests/components/test_request_stream.py): it returns None (FSDP2's Shard(0)) for each tensor
    of a dense decoder, so the plan's stream is dim0's, and it replays."""
    torch = pytest.importorskip("torch")
    from llmem.runtime.parallel import _dim1_if_short

    p = TrainingPlan(gpus=gpus, zero=3, fsdp_shard="dim1-if-short", **MIXED)
    spec = _spec("qwen2.5-0.5b", p)
    placement = _dim1_if_short(gpus)
    assert all(placement(torch.empty(t.shape, device="meta")) is None for t in spec.params)
    assert rs.replays(spec, p)
    assert rs.program_requests(spec, p).events == rs.program_requests(spec, p.with_(fsdp_shard="dim0")).events


def test_the_checkpointed_layer_keeps_its_input_and_recomputes_in_backward():
    """Full checkpointing: the forward keeps one residual-stream tensor per layer (the checkpoint's input) instead
    of the layer's saved tensors, which the backward makes again; the stream's allocated bytes at the end of
    forward fall by the layers' saved bytes less their inputs."""
    p = TrainingPlan(gpus=8, zero=3, **MIXED)
    ck = p.with_(grad_ckpt="full")
    spec = _spec("qwen2.5-0.5b", p)

    def at_loss(plan):
        req = rs.program_requests(spec, plan)
        return sum(n for n, _ in _live(req.events, dict(req.marks)["loss 1"]).values())

    sizes = rs._PlanSizes(spec, p)
    saved = sum(sizes.table) - sizes.residual
    assert at_loss(p) - at_loss(ck) == spec.num_layers * saved


@pytest.mark.heavy
@pytest.mark.parametrize("plan", [{"gpus": 8, "zero": 2}, {"gpus": 8, "tp": 2, "zero": 3},
                                  {"gpus": 8, "zero": 3, "grad_ckpt": "full"},
                                  {"gpus": 4, "zero": 3, "fsdp_shard": "dim1-if-short"}])
def test_fsdp2_replay_against_simulate(plan):
    """qwen2.5-0.5b, 1 × 1024, bf16-mixed: the replay within 3 % of simulate's replay of the fake-tensor run (every
    aten allocation of the real runtime, each on its stream, through the same allocator model). ZeRO-3 alone:
    tests/components/test_reserved.py::test_reserved_against_simulate_at_full_size."""
    from llmem.simulate import simulate

    p = TrainingPlan(**MIXED, **plan)
    sim = simulate(load_preset("qwen2.5-0.5b"), p)
    ours = rs.replayed_reserved_bytes(_spec("qwen2.5-0.5b", p), p)
    assert abs(ours - sim.reserved_bytes) <= 0.03 * sim.reserved_bytes, (ours / 2**30, sim.reserved_bytes / 2**30)
