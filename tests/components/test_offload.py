"""--offload optimizer+params (FSDP2 CPUOffloadPolicy): what leaves the GPU, what the host holds, and what cannot
run here. The GPU side cannot be measured on this machine (see the last test); these tests check relations
between the offloaded and the resident walks that a wrong edit of either would break."""

import pytest

from llmem.components import Category, offload
from llmem.components.optimizer import optimizer_state_bytes, optimizer_step_temporary_bytes
from llmem.components.parameters import buffer_bytes, parameter_bytes
from llmem.errors import InputError
from llmem.estimate import estimate
from llmem.plan import TrainingPlan
from llmem.presets import load_preset
from llmem.spec import ModelSpec

SPEC = ModelSpec.from_config(load_preset("llama-3.2-1b-instruct"))
OFF = "optimizer+params"


def _pair(**kw):
    on = estimate(SPEC, TrainingPlan(**kw))
    off = estimate(SPEC, TrainingPlan(offload=OFF, **kw))
    return {p.name: p for p in on.phases}, {p.name: p for p in off.phases}, on, off


@pytest.mark.parametrize("zero", [2, 3])
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16", "fp32"])
def test_only_sharded_params_grads_states_and_step_leave_the_gpu(zero, precision):
    """Every phase keeps its activations, logits, communication buffers and unsharded gradients; what differs is
    exactly parameters + optimizer states (every phase) and sharded gradients and step temporaries."""
    on, off, _, _ = _pair(gpus=4, zero=zero, precision=precision)
    assert on.keys() == off.keys()
    plan = TrainingPlan(gpus=4, zero=zero, precision=precision)
    params, states = parameter_bytes(SPEC, plan), optimizer_state_bytes(SPEC, plan)
    buffers = buffer_bytes(SPEC, plan)  # fully_shard moves the buffers to the GPU; only the shards go to the host
    assert 0 < buffers < params
    for name, a in on.items():
        b = off[name]
        for cat in (Category.ACTIVATIONS, Category.LOGITS, Category.COMMUNICATION):
            assert a.breakdown[cat] == b.breakdown[cat], (name, cat)
        assert b.breakdown[Category.PARAMETERS] == buffers and b.breakdown[Category.OPTIMIZER] == 0
        assert a.breakdown[Category.PARAMETERS] == params and a.breakdown[Category.OPTIMIZER] == states
        assert 0 <= b.breakdown[Category.GRADIENTS] <= a.breakdown[Category.GRADIENTS]
        assert b.total < a.total


@pytest.mark.parametrize("impl", ["fused", "foreach", "forloop"])
def test_optimizer_step_moves_to_the_host_byte_for_byte(impl):
    """Conservation at the step: what the GPU no longer holds is exactly what the host holds — except AdamW's
    0-dim `step` tensors, which the non-fused implementations keep on the host even without offload."""
    on, off, _, est = _pair(gpus=4, zero=3, optimizer_impl=impl)
    moved = on["optimizer step"].total - off["optimizer step"].total
    already_on_host = 0 if impl == "fused" else 4 * len(SPEC.params)
    assert moved + already_on_host == est.host_bytes
    # and the GPU keeps nothing but the model output's logits and the buffers at the step
    step = off["optimizer step"]
    assert step.total == step.breakdown[Category.LOGITS] + step.breakdown[Category.PARAMETERS]
    assert step.breakdown[Category.PARAMETERS] == buffer_bytes(SPEC, est.plan)


def test_gpu_peak_does_not_depend_on_the_optimizer():
    """Optimizer states live on the host: AdamW and SGD give the same GPU peak, different host bytes."""
    adam = estimate(SPEC, TrainingPlan(gpus=4, zero=3, offload=OFF))
    sgd = estimate(SPEC, TrainingPlan(gpus=4, zero=3, offload=OFF, optimizer="sgd"))
    assert adam.peak_bytes == sgd.peak_bytes
    assert adam.host_bytes > sgd.host_bytes


def test_host_figures():
    plan = TrainingPlan(gpus=16, zero=3, offload=OFF, optimizer_impl="fused")
    est = estimate(SPEC, plan)
    h = est.host_breakdown
    resident = plan.with_(offload="none")
    shards = parameter_bytes(SPEC, resident) - buffer_bytes(SPEC, resident)  # the buffers stay on the GPU
    assert h[Category.PARAMETERS] == h[Category.GRADIENTS] == shards
    assert h[Category.TEMPORARIES] == optimizer_step_temporary_bytes(SPEC, plan) == 0  # fused: in place
    # pinned blocks are rounded up to powers of two: at least the bytes, less than twice
    assert h[Category.PARAMETERS] * 2 <= est.host_pinned_bytes < 4 * h[Category.PARAMETERS]
    assert est.host_node_bytes == 8 * est.host_bytes  # 16 ranks: 8 per node
    d = est.to_dict()
    assert d["host_bytes"] == est.host_bytes and sum(d["host_breakdown"].values()) == d["host_bytes"]
    assert sum(d["breakdown"].values()) == d["peak_bytes"]
    two = estimate(SPEC, TrainingPlan(gpus=2, zero=3, offload=OFF))
    assert two.host_node_bytes == 2 * two.host_bytes and offload.ranks_per_node(two.plan) == 2
    assert estimate(SPEC, TrainingPlan(gpus=4, zero=3)).host_bytes == 0


@pytest.mark.parametrize("kw, needle", [
    (dict(gpus=4, zero=3, offload="optimizer"), "single-GPU"),
    (dict(gpus=1, offload=OFF), "--zero 2 or 3"),
    (dict(gpus=4, zero=0, offload=OFF), "--zero 2 or 3"),
    (dict(gpus=4, zero=1, offload=OFF), "--zero 2 or 3"),
    (dict(gpus=4, tp=2, zero=3, offload=OFF), "--tp 1"),
    (dict(gpus=4, zero=3, offload=OFF, device="cpu"), "cpu profile"),
])
def test_unmodelled_combinations_are_rejected(kw, needle):
    with pytest.raises(InputError) as err:
        TrainingPlan(**kw)
    assert err.value.field == "offload" and needle in str(err.value)


def test_cpu_mesh_cannot_run_the_offload_policy():
    """The exact behaviour behind rejecting --device cpu: FSDP2's default CPUOffloadPolicy pins host memory,
    which needs an accelerator; without pinning the copies are no-ops (the device is the host)."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from torch.distributed.fsdp import CPUOffloadPolicy

    with pytest.raises(RuntimeError, match="accelerator"):
        torch.zeros(4).pin_memory()
    assert CPUOffloadPolicy().pin_memory is True
