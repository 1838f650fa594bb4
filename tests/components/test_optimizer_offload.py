"""--offload optimizer (torchao's CPUOffloadOptimizer on one GPU). Its GPU side cannot be measured on this machine
(torchao asserts a CUDA or XPU device), so these tests check the modelled bytes against the real model's parameter
tensors (built on the meta device by transformers, independently of the estimator's spec) and against the resident
walk, and the runtime's construction of the optimizer against torchao's signature."""

import sys
import types

import pytest
import torch

from llmem.components import Category
from llmem.errors import InputError
from llmem.estimate import estimate
from llmem.plan import TrainingPlan
from llmem.presets import load_preset
from llmem.spec import ModelSpec

MINIMAL_SIZE = 4096  # torchao.optim.CPUOffloadOptimizer's default minimal_size
PRESETS = ("llama-3.2-1b-instruct", "llama-3.1-8b", "gpt2")


def _meta_params(preset: str, precision: str) -> dict[str, torch.Tensor]:
    """The model's trainable tensors as transformers builds them (tied weights once), in the plan's parameter dtype."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = load_preset(preset)
    hf = AutoConfig.for_model(**config)
    dtype = torch.float32 if precision.endswith("mixed") or precision == "fp32" else torch.bfloat16
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf, torch_dtype=dtype)
    return dict(model.named_parameters())


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16"])
def test_host_holds_copy_gradient_and_states_of_every_large_tensor(preset, precision):
    params = _meta_params(preset, precision)
    large = [t for t in params.values() if t.numel() >= MINIMAL_SIZE]
    est = estimate(ModelSpec.from_config(load_preset(preset)),
                   TrainingPlan(offload="optimizer", precision=precision, optimizer_impl="fused"))
    host = est.host_breakdown
    assert host[Category.PARAMETERS] == host[Category.GRADIENTS] == _bytes(large)
    assert host[Category.OPTIMIZER] == 2 * _bytes(large) + 4 * len(large)  # exp_avg, exp_avg_sq, 0-dim fp32 step
    assert host[Category.TEMPORARIES] == 0  # fused: no step temporaries
    assert est.host_node_bytes == est.host_bytes  # one GPU, one rank on the node


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_gpu_keeps_states_and_gradients_of_small_tensors_only(preset, impl):
    params = _meta_params(preset, "bf16-mixed")
    small = [t for t in params.values() if t.numel() < MINIMAL_SIZE]
    est = estimate(ModelSpec.from_config(load_preset(preset)), TrainingPlan(offload="optimizer", optimizer_impl=impl))
    step = {p.name: p for p in est.phases}["optimizer step"].breakdown
    steps_on_gpu = 4 * len(small) if impl == "fused" else 0  # foreach keeps `step` on the host (cuda profile)
    assert step[Category.OPTIMIZER] == 2 * _bytes(small) + steps_on_gpu
    assert step[Category.GRADIENTS] == _bytes(small)  # every large gradient was dropped by its hook


@pytest.mark.parametrize("preset", PRESETS)
def test_backward_holds_no_large_gradient_of_later_layers(preset):
    """At the first layer's backward the resident walk holds every later layer's gradients and the head's; with
    offloaded gradients the difference is exactly the large ones among them (tied: the shared weight's stays, waiting
    in its InputBuffer for the embedding's gradient)."""
    cfg = load_preset(preset)
    params = _meta_params(preset, "fp32")
    spec = ModelSpec.from_config(cfg)
    on = {p.name: p for p in estimate(spec, TrainingPlan(precision="fp32")).phases}
    off = {p.name: p for p in estimate(spec, TrainingPlan(precision="fp32", offload="optimizer")).phases}
    name = "backward (first layer)"
    dropped = [t for n, t in params.items() if t.numel() >= MINIMAL_SIZE and ".0." not in n
               and not any(e in n for e in ("embed_tokens", "wte", "wpe"))]
    assert on[name].breakdown[Category.GRADIENTS] - off[name].breakdown[Category.GRADIENTS] == _bytes(dropped)


def test_accumulation_keeps_gradients_on_the_gpu():
    """torchao refuses offload_gradients under accumulation: every gradient figure equals the resident walk's."""
    spec = ModelSpec.from_config(load_preset("llama-3.2-1b-instruct"))
    on = estimate(spec, TrainingPlan(grad_accum=2))
    off = estimate(spec, TrainingPlan(grad_accum=2, offload="optimizer"))
    assert [p.name for p in on.phases] == [p.name for p in off.phases]
    for a, b in zip(on.phases, off.phases, strict=True):
        assert a.breakdown[Category.GRADIENTS] == b.breakdown[Category.GRADIENTS], a.name
        assert a.breakdown[Category.ACTIVATIONS] == b.breakdown[Category.ACTIVATIONS], a.name
    assert off.peak_bytes < on.peak_bytes


def test_offload_lowers_the_8b_peak_by_at_least_the_large_states():
    spec = ModelSpec.from_config(load_preset("llama-3.1-8b"))
    on, off = estimate(spec, TrainingPlan()), estimate(spec, TrainingPlan(offload="optimizer"))
    assert on.peak_bytes - off.peak_bytes >= off.host_breakdown[Category.OPTIMIZER] - 4 * len(spec.params)


@pytest.mark.parametrize("kw, needle", [
    (dict(gpus=2), "single-GPU"),
    (dict(method="lora"), "--method full"),
    (dict(optimizer="adafactor"), "adamw or sgd"),
    (dict(device="cpu"), "cpu profile"),
])
def test_plans_outside_the_model_are_refused_naming_offload(kw, needle):
    with pytest.raises(InputError) as err:
        TrainingPlan(offload="optimizer", **kw)
    assert err.value.field == "offload" and needle in str(err.value)


@pytest.mark.parametrize("accum, impl", [(1, "foreach"), (4, "fused")])
def test_runtime_builds_torchao_offload_optimizer(monkeypatch, accum, impl):
    """The program: torchao.optim.CPUOffloadOptimizer over the plan's torch class with its explicit flags, gradients
    offloaded only without accumulation. torchao needs CUDA, so its class is replaced by a recorder here."""
    from llmem.runtime.optim import make_optimizer

    calls = {}

    class Recorder:
        def __init__(self, params, optimizer_class, *, offload_gradients=False, minimal_size=4096, **kwargs):
            calls.update(params=params, cls=optimizer_class, offload_gradients=offload_gradients,
                         minimal_size=minimal_size, kwargs=kwargs)

    fake = types.ModuleType("torchao.optim")
    fake.CPUOffloadOptimizer = Recorder
    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))
    monkeypatch.setitem(sys.modules, "torchao.optim", fake)
    weight = torch.nn.Parameter(torch.zeros(4))
    plan = TrainingPlan(offload="optimizer", grad_accum=accum, optimizer_impl=impl)
    make_optimizer([weight], plan)
    assert calls["cls"] is torch.optim.AdamW and calls["params"] == [weight]
    assert calls["offload_gradients"] is (accum == 1) and calls["minimal_size"] == MINIMAL_SIZE
    assert calls["kwargs"]["fused"] is (impl == "fused") and calls["kwargs"]["foreach"] is (impl == "foreach")
