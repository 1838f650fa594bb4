"""Memory-saving optimizers (torch Adafactor, bitsandbytes AdamW8bit / PagedAdamW8bit): state bytes against the
states the libraries themselves create, and the single-rank estimate against a real CPU run within 2 %."""

from __future__ import annotations

import pytest

from llmem.components import optimizer as opt
from llmem.errors import InputError
from llmem.estimate import estimate
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from tests.components.test_activations import CONFIGS


def _unique_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        key = (t.device.type, t.data_ptr() if t.device.type != "meta" else id(t))
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("family,precision", [("llama", "fp32"), ("gpt2", "bf16"), ("falcon", "fp32")])
def test_adafactor_states_equal_torch_on_meta(family, precision):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from llmem.runtime.model import hf_config

    plan = TrainingPlan(optimizer="adafactor", precision=precision, device="cpu")
    dtype = getattr(torch, plan.precision.torch_dtype_name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(CONFIGS[family], plan), dtype=dtype)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.empty_like(p)
    o = torch.optim.Adafactor(params)
    o._init_group(o.param_groups[0], [], [], [], [], [], [])
    state = [t for s in o.state.values() for k, t in s.items() if k != "step"]
    steps = [s["step"] for s in o.state.values()]
    spec = ModelSpec.from_config(CONFIGS[family])
    expected = _unique_bytes(state) + sum(t.numel() * t.element_size() for t in steps)  # CPU profile counts steps
    assert opt.optimizer_state_bytes(spec, plan) == expected
    # the walk order of the for-loop step is model.parameters() order
    assert [tuple(p.shape) for p in params] == opt.optimized_shapes(spec, plan)


@pytest.mark.parametrize("family,optimizer,precision", [
    ("llama", "adamw8bit", "fp32"), ("gpt2", "adamw8bit", "bf16"), ("qwen3", "paged-adamw8bit", "bf16-mixed"),
])
def test_bnb_states_equal_bitsandbytes_init_state(family, optimizer, precision):
    torch = pytest.importorskip("torch")
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM

    from llmem.runtime.model import hf_config
    from llmem.runtime.optim import make_optimizer

    plan = TrainingPlan(optimizer=optimizer, precision=precision, device="cpu")
    model = AutoModelForCausalLM.from_config(hf_config(CONFIGS[family], plan),
                                             dtype=getattr(torch, plan.precision.torch_dtype_name))
    o = make_optimizer(model.parameters(), plan)
    for i, p in enumerate(o.param_groups[0]["params"]):
        o.init_state(o.param_groups[0], p, 0, i)
    state = [t for s in o.state.values() for t in s.values() if torch.is_tensor(t)]
    spec = ModelSpec.from_config(CONFIGS[family])
    assert opt.optimizer_state_bytes(spec, plan) == _unique_bytes(state)
    assert any(t.dtype == torch.uint8 for t in state) and any(t.dtype == torch.float32 for t in state)


def test_paged_states_leave_the_allocator_on_cuda():
    spec = ModelSpec.from_config(CONFIGS["llama"])  # embeddings and lm_head have 192,000 elements (>= 1e5)
    cuda = estimate(spec, TrainingPlan(optimizer="paged-adamw8bit", batch_size=2, seq_len=64))
    plain = estimate(spec, TrainingPlan(optimizer="adamw8bit", batch_size=2, seq_len=64))
    paged = 2 * 2 * 192_000  # state1 + state2 (uint8) of the two tensors with >= 1e5 elements
    assert cuda.paged_state_bytes == paged
    assert plain.paged_state_bytes == 0
    assert sum(cuda.breakdown.values()) == cuda.peak_bytes
    assert cuda.phases[-1].breakdown != plain.phases[-1].breakdown
    assert cuda.device_total_bytes == cuda.reserved_bytes + cuda.cuda_context_bytes + paged
    cpu = estimate(spec, TrainingPlan(optimizer="paged-adamw8bit", batch_size=2, seq_len=64, device="cpu"))
    assert cpu.paged_state_bytes == 0  # bitsandbytes falls back to ordinary tensors on CPU


def test_adafactor_defaults_to_the_for_loop_on_cuda():
    assert TrainingPlan(optimizer="adafactor").effective_optimizer_impl.value == "forloop"


def test_validation_names_the_flag():
    for optimizer in ("adafactor", "adamw8bit", "paged-adamw8bit"):
        with pytest.raises(InputError, match="optimizer"):
            TrainingPlan(optimizer=optimizer, gpus=2, zero=3)
        with pytest.raises(InputError, match="optimizer"):
            TrainingPlan(optimizer=optimizer, gpus=2, tp=2)
        TrainingPlan(optimizer=optimizer, gpus=2, zero=1)
    with pytest.raises(InputError, match="optimizer-impl"):
        TrainingPlan(optimizer="adafactor", optimizer_impl="fused")
    with pytest.raises(InputError, match="optimizer-impl"):
        TrainingPlan(optimizer="adamw8bit", optimizer_impl="foreach")


def _errors(family: str, **plan) -> tuple[float, float]:
    """Relative errors of the peak and of the optimizer step's own peak (the step rarely sets the overall peak
    with these optimizers, so it is checked on its own: the timeline's last "optimizer" phase)."""
    from llmem.measure.timeline import phases, timeline

    p = TrainingPlan(device="cpu", batch_size=2, seq_len=64, **plan)
    trace = timeline(CONFIGS[family], p)
    step = [ph for ph in phases(trace) if ph.name.startswith("optimizer")][-1].peak
    est = estimate(ModelSpec.from_config(CONFIGS[family]), p)
    est_step = next(ph.total for ph in est.phases if ph.name == "optimizer step")
    return (est.peak_bytes - trace.peak_bytes) / trace.peak_bytes, (est_step - step) / step


@pytest.mark.parametrize("family,plan", [
    ("llama", dict(optimizer="adafactor", precision="fp32")),
    ("llama", dict(optimizer="adafactor", precision="bf16")),
    ("llama", dict(optimizer="adafactor", precision="bf16-mixed")),
    ("llama", dict(optimizer="adafactor", precision="fp32", optimizer_impl="foreach")),
    ("gpt2", dict(optimizer="adafactor", precision="fp32")),
    ("llama", dict(optimizer="adamw8bit", precision="fp32")),
    ("llama", dict(optimizer="adamw8bit", precision="bf16")),
    ("qwen3", dict(optimizer="paged-adamw8bit", precision="bf16-mixed")),
    ("gpt2", dict(optimizer="adamw8bit", precision="fp32")),
])
def test_peak_within_2_percent(family, plan):
    pytest.importorskip("torch")
    if "8bit" in plan["optimizer"]:
        pytest.importorskip("bitsandbytes")
    peak, step = _errors(family, **plan)
    assert abs(peak) < 0.02
    assert abs(step) < 0.02
