"""`--offload optimizer+params` simulated on the fake accelerator (llmem/simulate/fake_cuda.py) against the estimate.

No CPU run can measure these plans (a CPU mesh makes every host-device copy a no-op), so the simulation is the
oracle: it runs FSDP2's own offload path (`CPUOffloadPolicy`: pinned host shards, `.to(device)` before each
all-gather, each reduce-scatter output copied to the host) and counts device and host storages apart.
Bounds: the GPU peak within 0.1% — the tiny configuration's residual is 952 B (0.05%), the same as ZeRO-3 without
offload on it (the offload moves nothing else on the device); full size 16 KiB (0.0002%), the issue's bound is
1%. Host bytes within 0.1%: equal to the byte on every row but the for-loop step (896 B of its temporaries on
qwen2.5-0.5b, 0.00004%).
"""

import importlib.util

import pytest

from llmem.errors import InputError
from llmem.estimate import estimate
from llmem.plan import TrainingPlan
from llmem.presets import load_preset
from llmem.simulate import simulate
from llmem.spec import ModelSpec
from tests.measure.conftest import LLAMA

TINY = dict(device="cuda", batch_size=2, seq_len=64, offload="optimizer+params")


def _compare(config: dict, plan: TrainingPlan, per_mille: int = 1) -> None:
    sim = simulate(dict(config), plan)
    est = estimate(ModelSpec.from_config(dict(config)), plan)
    slack = sim.peak_bytes * per_mille // 1000
    assert abs(est.peak_bytes - sim.peak_bytes) <= slack, (est.peak_bytes, sim.peak_bytes)
    assert sim.host_bytes > 0
    assert abs(est.host_bytes - sim.host_bytes) <= sim.host_bytes // 1000, (est.host_bytes, sim.host_bytes)


@pytest.mark.parametrize("plan, per_mille", [
    ({"gpus": 4, "zero": 3}, 1),
    pytest.param({"gpus": 4, "zero": 2}, 1, marks=pytest.mark.heavy),
    pytest.param({"gpus": 2, "zero": 3, "precision": "bf16", "optimizer": "sgd"}, 1, marks=pytest.mark.heavy),
    # the simulated peak is in layer 0's recomputed backward, 2,248 B (0.18%) above the estimate's largest moment;
    # ZeRO-3 with checkpointing and no offload on this configuration differs by 9,160 B (0.42%) too, and
    # qwen2.5-0.5b on 8 ranks by 16 KiB (0.0003%): the estimate's moment on a tiny layer, not the offload
    pytest.param({"gpus": 2, "zero": 3, "grad_ckpt": "full"}, 5, marks=pytest.mark.heavy),
    pytest.param({"gpus": 2, "zero": 2, "method": "lora", "lora_targets": "all-linear", "precision": "bf16"}, 1,
                 marks=pytest.mark.heavy),
], ids=["zero3", "zero2", "bf16-sgd", "ckpt", "lora-bf16"])
def test_offload_matches_the_estimate_small(plan, per_mille):
    """One spawned process per simulation (`llmem.simulate.isolate`, about 10 s of imports): one row by default,
    the rest under -m heavy. A backward runs here first (the autograd engine's device queues are made then, which a
    simulation in this process could not use), and this process never registers the fake backend."""
    import torch

    torch.ones(1, requires_grad=True).sum().backward()
    _compare(LLAMA, TrainingPlan(**{**TINY, **plan}), per_mille)
    assert torch._C._get_privateuse1_backend_name() == "privateuseone"


@pytest.mark.heavy
def test_offloaded_state_is_host_memory_not_device():
    """The same plan with and without offload: offloading takes the sharded parameters (fp32 under bf16-mixed),
    gradients and AdamW's two states off the device, so at the reset (after wrapping) the device holds no
    parameter shard, and the host the shards of every parameter."""
    plan = TrainingPlan(**{**TINY, "gpus": 4, "zero": 3})
    off = simulate(dict(LLAMA), plan)
    on = simulate(dict(LLAMA), plan.with_(offload="none"))
    assert off.host_bytes > 0 and on.host_bytes == 0
    assert off.live_at_reset < on.live_at_reset
    assert off.peak_bytes < on.peak_bytes


def test_optimizer_offload_is_refused_in_one_line():
    """torchao's CPUOffloadOptimizer: not installed here, and its constructor asserts a CUDA or XPU device."""
    with pytest.raises(InputError) as err:
        simulate(dict(LLAMA), TrainingPlan(device="cuda", batch_size=2, seq_len=64, offload="optimizer"))
    assert err.value.field == "offload"
    assert "torchao" in str(err.value) and "\n" not in str(err.value)
    if importlib.util.find_spec("torchao") is None:
        assert "not installed" in str(err.value)


@pytest.mark.heavy
@pytest.mark.parametrize("preset", ["llama-3.2-1b-instruct", "qwen2.5-0.5b"])
@pytest.mark.parametrize("plan", [{"zero": 2}, {"zero": 3}, {"zero": 3, "gpus": 8, "grad_ckpt": "full"},
                                  {"zero": 3, "method": "lora"}], ids=["zero2", "zero3", "zero3-ckpt-8", "lora"])
def test_offload_matches_the_estimate_full_size(preset, plan):
    """The presets at their defaults (4 ranks unless said; 5-25 s each)."""
    _compare(load_preset(preset), TrainingPlan(**{"device": "cuda", "gpus": 4, "offload": "optimizer+params",
                                                  **plan}))
