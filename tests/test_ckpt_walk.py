"""The `--ckpt-every K` walk evaluates only the ends of each linear run of layers (`activations.backward_layers`),
and the checkpointing planner estimates a few K per recomputed-layer count where the layers' trend allows
(`checkpointing._group_choice`). Both are compared here with the algorithms they replaced, kept below as oracles:
the walk over the full K (+ edge - 1) layers at each end, and the planner that estimates every K on that walk.
Everything an estimate reports but its list of evaluated moments must be identical (the moments the new walk keeps
are a subset of the old ones, with identical breakdowns), and the planner's answer identical to the byte."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from llmem import checkpointing
from llmem.components import activations as act
from llmem.components.sharding import FSDP_SCHEMES
from llmem.errors import InputError
from llmem.estimate import estimate
from llmem.plan import GradCkpt, TrainingPlan
from llmem.spec import ModelSpec
from tests.components.test_activations import CONFIGS, DROPOUT


def old_backward_layers(spec: ModelSpec, plan: TrainingPlan, edge: int = 1) -> list[int]:
    """The walk before: every layer of the K (+ edge - 1) layers at each end."""
    n = spec.num_layers
    span = edge if plan.grad_ckpt is not GradCkpt.FULL or plan.ckpt_every == 1 else plan.ckpt_every + edge - 1
    return sorted({*range(min(span, n)), *range(max(n - span, 0), n)}, reverse=True)


def old_plan_checkpointing(spec: ModelSpec, plan: TrainingPlan, capacity: int) -> checkpointing.CkptPlan:
    """The planner before: every candidate estimated, the lowest device total kept per recomputed-layer count."""
    per_layer = checkpointing.layer_forward_flops(spec, plan) * plan.grad_accum
    best: dict[int, checkpointing.CkptOption] = {}
    for p in checkpointing.candidate_plans(spec, plan):
        n = -(-spec.num_layers // p.ckpt_every) if p.grad_ckpt is GradCkpt.FULL else 0
        opt = checkpointing.CkptOption(p, estimate(spec, p), n, n * per_layer, capacity)
        if n not in best or opt.estimate.device_total_bytes < best[n].estimate.device_total_bytes:
            best[n] = opt
    options = tuple(best[n] for n in sorted(best))
    chosen = next((o for o in options if o.fits), None)
    return checkpointing.CkptPlan(spec, capacity, options, chosen,
                                  checkpointing.model_forward_flops(spec, plan) * plan.grad_accum)


def at_capacity(spec: ModelSpec, plan: TrainingPlan, options, capacity: int) -> checkpointing.CkptPlan:
    """The old planner's answer at another capacity: the same options (the capacity only decides which fit)."""
    options = tuple(replace(o, capacity_bytes=capacity) for o in options)
    chosen = next((o for o in options if o.fits), None)
    return checkpointing.CkptPlan(spec, capacity, options, chosen,
                                  checkpointing.model_forward_flops(spec, plan) * plan.grad_accum)


def deep(family: str, layers: int) -> ModelSpec:
    name, _, dropout = family.partition("-")
    cfg = dict((DROPOUT if dropout else CONFIGS)[name])
    family = name
    cfg["n_layer" if family in ("gpt2", "bloom") else "num_hidden_layers"] = layers
    return ModelSpec.from_config(cfg)


def fresh(spec: ModelSpec) -> ModelSpec:
    """The same model with empty memos: the estimate keeps each plan's walk on the spec, so a walk patched to the
    old one must run on a spec that has not walked the plan yet (its other attributes, e.g. `source_config`, kept)."""
    clone = copy.copy(spec)
    clone.__dict__.update(_memo={}, _plan_memo={})
    return clone


def old_estimate(spec: ModelSpec, plan: TrainingPlan, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(act, "backward_layers", old_backward_layers)
        return estimate(fresh(spec), plan)


def assert_same_estimate(new, old) -> None:
    a, b = new.to_dict(), old.to_dict()
    new_phases, old_phases = a.pop("phases"), b.pop("phases")
    assert a == b
    assert new.breakdown == old.breakdown and new.peak_phase == old.peak_phase
    assert all(old_phases[name] == total for name, total in new_phases.items())  # a subset, totals identical


# (family, plan options): single GPU, DDP, ZeRO-1/2/3, TP, TP x FSDP2, LoRA (plain and under FSDP2), QLoRA, 8-bit
# bases, pure half precision, gradient accumulation, offload, the cpu profile; activation-heavy and gradient-heavy
PLANS = [
    ("llama", dict(batch_size=4, seq_len=256)),
    ("llama", dict(batch_size=1, seq_len=16)),
    ("llama", dict(gpus=2, batch_size=2, seq_len=64)),
    ("llama", dict(gpus=2, zero=1, batch_size=1, seq_len=16)),
    ("llama", dict(gpus=4, zero=2, batch_size=2, seq_len=64)),
    ("llama", dict(gpus=8, zero=3, batch_size=1, seq_len=64)),
    ("llama", dict(gpus=4, zero=3, grad_accum=2, batch_size=1, seq_len=16)),
    ("llama", dict(gpus=4, zero=3, device="cpu", optimizer_impl="forloop", batch_size=2, seq_len=64)),
    ("llama", dict(gpus=2, tp=2, batch_size=2, seq_len=64)),
    ("llama", dict(gpus=4, tp=2, zero=3, batch_size=2, seq_len=64)),
    ("llama", dict(method="lora", batch_size=4, seq_len=128)),
    ("llama", dict(method="lora", lora_dropout=0.1, batch_size=1, seq_len=16)),
    ("llama-dropout", dict(batch_size=2, seq_len=64)),
    ("gpt2-dropout", dict(gpus=2, batch_size=1, seq_len=16)),
    ("llama", dict(method="lora", gpus=4, zero=3, lora_dropout=0.1, batch_size=2, seq_len=64)),
    ("llama", dict(method="lora", gpus=4, zero=3, precision="bf16", batch_size=1, seq_len=16)),
    ("llama", dict(method="qlora", quant="nf4", precision="bf16", batch_size=2, seq_len=64)),
    ("llama", dict(method="qlora", quant="int8", precision="bf16", batch_size=2, seq_len=64)),
    ("llama", dict(precision="bf16", grad_accum=3, batch_size=2, seq_len=64)),
    ("llama", dict(offload="optimizer", batch_size=2, seq_len=64)),
    ("llama", dict(device="cpu", optimizer_impl="forloop", batch_size=4, seq_len=256)),
    ("gpt2", dict(batch_size=4, seq_len=128)),
    ("gpt2", dict(gpus=4, zero=3, batch_size=1, seq_len=16)),
    ("opt", dict(gpus=2, zero=1, batch_size=2, seq_len=64)),
    ("bloom", dict(batch_size=2, seq_len=64)),
    ("falcon", dict(batch_size=2, seq_len=64)),  # (eager with checkpointing: the returned probabilities'
    #   moment, `returned_probs`, tests/components/test_returned_probs.py)
    ("falcon", dict(gpus=4, zero=2, batch_size=2, seq_len=64)),
    ("gemma2", dict(batch_size=2, seq_len=64)),
    ("mixtral", dict(batch_size=2, seq_len=64)),
    ("qwen2_moe", dict(gpus=4, zero=3, batch_size=1, seq_len=32)),
    ("phi3", dict(precision="fp16-mixed", batch_size=2, seq_len=64)),
    ("gpt_neox", dict(gpus=2, batch_size=2, seq_len=64)),
]


def _plan(options: dict) -> TrainingPlan | None:
    try:
        return TrainingPlan(grad_ckpt="full", **options)
    except Exception:  # noqa: BLE001 - a combination this version does not accept is skipped, not failed
        return None


def _base(family: str, options: dict) -> TrainingPlan:
    if family.partition("-")[0] not in CONFIGS:
        pytest.skip(f"no test config for {family}")
    base = _plan(options)
    if base is None:
        pytest.skip("plan not accepted")
    return base


IDS = [f"{f}-{i}" for i, (f, _) in enumerate(PLANS)]


@pytest.mark.parametrize("family,options", PLANS, ids=IDS)
def test_walk_matches_the_full_spans(family, options, monkeypatch):
    """Every K (and K > L) on 1-13 layers: the run-end walk against the walk over the full spans."""
    base = _base(family, options)
    for layers in (1, 2, 3, 5, 8, 13):
        spec = deep(family, layers)
        for k in range(1, layers + 2):
            try:
                plan = base.with_(ckpt_every=k)
            except InputError:  # not offered (an int8 base checkpoints every layer or none)
                continue
            try:
                new = estimate(spec, plan)
            except Exception as e:  # noqa: BLE001 - the same refusal from both
                with pytest.raises(type(e)):
                    old_estimate(spec, plan, monkeypatch)
                continue
            assert_same_estimate(new, old_estimate(spec, plan, monkeypatch))


@pytest.mark.parametrize("family,options", PLANS, ids=IDS)
def test_planner_matches_estimating_every_k(family, options, monkeypatch):
    """The planner (which estimates a few K per recomputed-layer count where the layer trend allows) against the
    old planner on the old walk, at capacities where full, partial, none and nothing fit: the same options (K,
    estimate, recompute cost) and the same choice."""
    base = _base(family, options)
    deepest = 24 if base.scheme in FSDP_SCHEMES else 40  # (the old planner is slow on FSDP2 LoRA)
    for layers in (2, 4, 5, 13, deepest):
        spec = deep(family, layers)
        try:
            none = estimate(spec, base.with_(grad_ckpt="none"))
        except Exception:  # noqa: BLE001 - a plan the model refuses: refused by both planners
            with pytest.raises(Exception):  # noqa: B017
                checkpointing.plan_checkpointing(spec, base, 1 << 40)
            continue
        full = estimate(spec, base).device_total_bytes
        with monkeypatch.context() as m:
            m.setattr(act, "backward_layers", old_backward_layers)
            old_options = old_plan_checkpointing(fresh(spec), base, 1).options
        for capacity in (full - 1, (full + none.device_total_bytes) // 2, none.device_total_bytes + 1):
            new_plan = checkpointing.plan_checkpointing(spec, base, capacity)
            old_plan = at_capacity(spec, base, old_options, capacity)
            assert new_plan.to_dict() == old_plan.to_dict()
            assert new_plan.reason == old_plan.reason
            for a, b in zip(new_plan.options, old_plan.options, strict=True):
                assert_same_estimate(a.estimate, b.estimate)
