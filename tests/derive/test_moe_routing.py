"""Routing does not change the peak of the derived mixture-of-experts model types (`llmem.derive.experts`): their
experts run transformers 5.23's grouped matmuls over all tokens × top_k rows, so the traced tables need no routing
and `peak_bytes_range` is one point. Measured on CPU, two real steps each: the model's own routing (random init:
tokens spread over the experts) against every token sent to the same top_k experts (the experts' index argument
overwritten in place before they run, through `.data` so autograd sees the same tensor). The default suite runs
qwen3_moe; the rest are marked heavy (`-m heavy`)."""

import pytest
import torch

from llmem.derive.experts import DERIVED_MOE
from llmem.estimate import estimate
from llmem.measure.counting import CountingTracker
from llmem.measure.run import measure_rank
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from tests.derive.configs import config

FAST = ("qwen3_moe",)


def _same_experts(hit: set):
    def route(module, args):
        indices = args[1]
        indices.data.copy_(torch.arange(indices.shape[-1]).expand_as(indices))
        hit.update(indices.unique().tolist())

    def install(session, mark):
        for m in session.model.modules():
            if hasattr(m, "_is_expert_parallel"):  # experts made by `use_experts_implementation`
                m.register_forward_pre_hook(route)
    return install


@pytest.mark.parametrize("model_type", [m if m in FAST else pytest.param(m, marks=pytest.mark.heavy)
                                        for m in DERIVED_MOE])
def test_derived_moe_peak_does_not_depend_on_routing(model_type):
    cfg = config(model_type)
    attn = "eager" if model_type == "gpt_oss" else "sdpa"
    plan = TrainingPlan(batch_size=2, seq_len=64, precision="bf16-mixed", attn=attn, device="cpu")
    spread = measure_rank(cfg, plan, tracker=CountingTracker())["peak_bytes"]
    hit: set = set()
    skewed = measure_rank(cfg, plan, tracker=CountingTracker(), mark_hook=_same_experts(hit))["peak_bytes"]
    assert hit == {0, 1}  # every token went to experts 0 and 1
    assert skewed == spread
    est = estimate(ModelSpec.from_config(cfg), plan)
    assert est.peak_bytes_range == (est.peak_bytes, est.peak_bytes)
    assert any("Mixture of experts" in n for n in est.notes)
