"""The checkpointing planner: the least recomputation that fits, checked with estimate() on both sides of the choice,
and one choice against a real CPU measurement."""

from __future__ import annotations

import pytest

from llmem.checkpointing import layer_forward_flops, plan_checkpointing
from llmem.errors import InputError
from llmem.estimate import estimate
from llmem.plan import GradCkpt, TrainingPlan
from llmem.presets import load_preset
from llmem.spec import ModelSpec
from tests.components.test_activations import CONFIGS

GIB = 1 << 30


def _recomputed(spec: ModelSpec, plan: TrainingPlan) -> int:
    if plan.grad_ckpt is GradCkpt.NONE:
        return 0
    return sum(plan.checkpointed(i) for i in range(spec.num_layers))


@pytest.mark.parametrize("preset,plan,frac", [
    ("llama-3.1-8b", TrainingPlan(gpus=8, zero=3, batch_size=2, seq_len=4096), 0.9),
    ("llama-3.1-8b", TrainingPlan(gpus=8, zero=3, batch_size=2, seq_len=4096), 0.3),
    ("llama-3.1-8b", TrainingPlan(gpus=8, zero=3, batch_size=2, seq_len=4096), 0.01),
    ("qwen2.5-0.5b", TrainingPlan(batch_size=4, seq_len=2048), 0.5),
    ("qwen2.5-0.5b", TrainingPlan(gpus=2, batch_size=4, seq_len=2048, precision="bf16"), 0.2),
    ("gpt2", TrainingPlan(gpus=2, zero=1, batch_size=8, seq_len=1024), 0.6),
    ("qwen2.5-0.5b", TrainingPlan(gpus=2, tp=2, batch_size=4, seq_len=2048), 0.6),
])
def test_choice_fits_and_every_less_recomputing_choice_does_not(preset, plan, frac):
    """Capacity at `frac` of the way from full checkpointing's device total to no checkpointing's."""
    spec = ModelSpec.from_config(load_preset(preset))
    full = estimate(spec, plan.with_(grad_ckpt="full")).device_total_bytes
    capacity = int(full + frac * (estimate(spec, plan).device_total_bytes - full))
    result = plan_checkpointing(spec, plan, capacity)
    assert result.chosen is not None, result.reason
    chosen = result.chosen.plan
    assert estimate(spec, chosen).device_total_bytes <= capacity
    n = _recomputed(spec, chosen)
    assert result.chosen.recomputed_layers == n
    # every K (and none) that recomputes fewer layers, estimated afresh, does not fit
    for k in range(1, spec.num_layers + 1):
        p = plan.with_(grad_ckpt="full", ckpt_every=k)
        if _recomputed(spec, p) < n:
            assert estimate(spec, p).device_total_bytes > capacity, k
    if n:
        assert estimate(spec, plan.with_(grad_ckpt="none", ckpt_every=1)).device_total_bytes > capacity
    assert (n > 0) == (result.chosen.extra_forward_flops > 0)


def test_partial_checkpointing_is_chosen_when_it_is_enough():
    """A budget that checkpointing every 4th layer meets, and no checkpointing does not: the planner picks partial
    checkpointing with at least that little recomputation (K >= 4), never full."""
    spec = ModelSpec.from_config(load_preset("llama-3.1-8b"))
    plan = TrainingPlan(gpus=8, zero=3, batch_size=2, seq_len=4096)
    every4 = estimate(spec, plan.with_(grad_ckpt="full", ckpt_every=4)).device_total_bytes
    assert estimate(spec, plan).device_total_bytes > every4
    result = plan_checkpointing(spec, plan, every4)
    assert result.chosen.plan.grad_ckpt is GradCkpt.FULL and 4 <= result.chosen.plan.ckpt_every <= spec.num_layers
    assert 0 < result.chosen.recomputed_layers <= spec.num_layers // 4


def test_nothing_fits_says_so():
    spec = ModelSpec.from_config(load_preset("llama-3.1-8b"))
    result = plan_checkpointing(spec, TrainingPlan(), 8 * GIB)
    assert result.chosen is None and "nothing fits" in result.reason
    with pytest.raises(InputError, match="gpu-type"):
        plan_checkpointing(spec, TrainingPlan(), 0)


def test_lora_offers_every_k_like_full_fine_tuning():
    spec = ModelSpec.from_config(load_preset("qwen2.5-0.5b"))
    result = plan_checkpointing(spec, TrainingPlan(method="lora", seq_len=8192, batch_size=4), 80 * GIB)
    full = plan_checkpointing(spec, TrainingPlan(seq_len=8192, batch_size=4), 80 * GIB)
    assert [o.label for o in result.options] == [o.label for o in full.options]
    assert len(result.options) > 2  # none, some every-K choices, full


def test_recompute_flops_follow_the_stated_formula():
    """2 × layer parameters × tokens + 4 × b × s² × heads·head_dim, per recomputed layer (llama-3.1-8b: 218 M
    parameters per layer, 32 heads of 128)."""
    spec = ModelSpec.from_config(load_preset("llama-3.1-8b"))
    plan = TrainingPlan(batch_size=1, seq_len=1000)
    per_layer = sum(p.numel for p in spec.layer_params(0))
    assert per_layer == 218_112_000
    assert layer_forward_flops(spec, plan) == 2 * 218_112_000 * 1000 + 4 * 1000 ** 2 * 4096
    mix = ModelSpec.from_config(CONFIGS["mixtral"])  # 4 experts, top-2: half of the expert weights are active
    experts = sum(p.numel for p in mix.layer_params(0) if ".experts." in p.name)
    dense = sum(p.numel for p in mix.layer_params(0)) - experts
    assert layer_forward_flops(mix, plan) == 2 * (dense + experts // 2) * 1000 + 4 * 1000 ** 2 * 240


def test_a_chosen_plan_fits_when_measured():
    """Integration: a capacity between the estimates of two neighbouring choices; the planner's choice, run for
    real on CPU, stays under it (and within 2 % of its estimate), and the next less recomputing choice's real peak
    exceeds it."""
    pytest.importorskip("torch")
    from llmem.measure.run import measure_rank

    cfg = dict(CONFIGS["llama"], num_hidden_layers=5)
    spec = ModelSpec.from_config(cfg)
    plan = TrainingPlan(device="cpu", optimizer_impl="forloop", batch_size=4, seq_len=256, precision="fp32")
    every2 = estimate(spec, plan.with_(grad_ckpt="full", ckpt_every=2)).peak_bytes
    every3 = estimate(spec, plan.with_(grad_ckpt="full", ckpt_every=3)).peak_bytes
    capacity = (every2 + every3) // 2
    result = plan_checkpointing(spec, plan, capacity)
    assert result.chosen.plan.ckpt_every == 2 and result.chosen.recomputed_layers == 3
    chosen = measure_rank(cfg, result.chosen.plan)["peak_bytes"]
    assert chosen <= capacity and abs(chosen - every2) < 0.02 * chosen
    less = next(o for o in result.options if o.recomputed_layers == 2)
    assert measure_rank(cfg, less.plan)["peak_bytes"] > capacity
