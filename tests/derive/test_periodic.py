"""Layers of several kinds: the walk evaluates the layers `llmem.derive.periodic` picks (up to one period past the
last release, the last period, the outermost), not all of them. Compared here with the walk over every layer, as
the oracle: the same peak, peak phase and breakdown, and every moment the shorter walk keeps identical to the same
moment of the full one. The models repeat with periods 2 (gemma2 under LoRA, gpt-oss) and 6 (gemma3)."""

from __future__ import annotations

import itertools

import pytest

from llmem.derive import periodic
from llmem.errors import InputError
from llmem.estimate import estimate
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from tests.components.test_activations import CONFIGS
from tests.derive.configs import config
from tests.test_ckpt_walk import fresh

MODELS = {
    "gemma3-26": (config("gemma3_text", num_hidden_layers=26, sliding_window=16), {}),
    "gpt_oss-10": (config("gpt_oss", num_hidden_layers=10, sliding_window=16), {"attn": "eager"}),
    "gemma2-lora-12": (dict(CONFIGS["gemma2"], num_hidden_layers=12), {"method": "lora", "attn": "eager"}),
}
PLANS = [dict(gpus=g, zero=z, precision=p, grad_ckpt=c, ckpt_every=k, grad_accum=a)
         for (g, z), p, (c, k), a in itertools.product(
             [(1, 0), (2, 0), (2, 3)], ["fp32", "bf16-mixed"], [("none", 1), ("full", 1), ("full", 2), ("full", 3)],
             [1, 2])]
# the default suite's two plans (its time budget): every-K checkpointing with accumulation, and FSDP2
QUICK = [dict(gpus=1, precision="bf16-mixed", grad_ckpt="full", ckpt_every=2, grad_accum=2),
         dict(gpus=2, zero=3, precision="fp32")]


def _all_layers(spec, plan, edge=1):
    return list(range(spec.num_layers - 1, -1, -1))


# the default suite: one model (its time budget: gpt_oss-10 ~20 s of CPU, gemma2-lora-12 ~100 s)
@pytest.mark.parametrize("name,plans", [("gpt_oss-10", QUICK)]
                         + [pytest.param(n, PLANS, marks=pytest.mark.heavy) for n in MODELS])
def test_the_periodic_walk_has_the_full_walks_peak_and_moments(name, plans, monkeypatch):
    cfg, fields = MODELS[name]
    spec, compared, shorter = ModelSpec.from_config(cfg), 0, 0
    for p in plans:
        try:
            plan = TrainingPlan(device="cpu", batch_size=2, seq_len=32, **{**p, **fields})
            short = estimate(spec, plan)
        except InputError:
            continue
        with monkeypatch.context() as m:
            m.setattr(periodic, "backward_layers", _all_layers)
            full = estimate(fresh(spec), plan)  # empty memos: the estimate keeps each plan's walk on the spec
        assert (short.peak_bytes, short.peak_phase, short.breakdown) == (full.peak_bytes, full.peak_phase,
                                                                         full.breakdown), p
        moments = {ph.name: ph for ph in full.phases}
        assert all(moments[ph.name] == ph for ph in short.phases), p
        compared += 1
        shorter += len(short.phases) < len(full.phases)
    assert compared >= 2 and shorter >= compared // 2, (compared, shorter)  # it ran, and the walk was shorter
