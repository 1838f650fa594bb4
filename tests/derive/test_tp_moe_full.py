"""Full fine-tuning of mixtral and qwen2_moe under TP (transformers' plan: `packed_colwise` experts.gate_up_proj,
`rowwise` experts.down_proj, `moe_tp_experts` on the experts module; the router and qwen2_moe's shared expert whole):
the TP spec keeps the family's expert widths, its layer backward is the traced window of TP rank 0
(`gradients.traced_experts`), and the estimate is within 1 % of 2 gloo CPU ranks (heavy)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.components.multirank import TwoRankRows

SUITE = yaml.safe_load((Path(__file__).parents[1] / "accuracy" / "suite.yaml").read_text())["models"]
WIDE = {"mixtral-wide": {**SUITE["mixtral"], "intermediate_size": 1024},
        "qwen2moe-wide": {**SUITE["qwen2_moe"], "moe_intermediate_size": 1024}}
CONFIGS = {**{k: SUITE[k] for k in ("mixtral", "qwen2_moe", "mixtral-attn", "qwen2moe-attn")}, **WIDE}
BASE = dict(gpus=2, tp=2, precision="fp32", optimizer_impl="forloop", batch_size=2, seq_len=64)
LONG = dict(batch_size=1, seq_len=256)
ROWS = {"mixtral": {}, "mixtral-bf16mix": dict(precision="bf16-mixed"), "mixtral-ckpt": dict(grad_ckpt="full"),
        "qwen2_moe": {}, "qwen2_moe-bf16mix": dict(precision="bf16-mixed"),
        "mixtral-attn": LONG, "qwen2moe-attn": LONG, "qwen2moe-attn-bf16mix": dict(LONG, precision="bf16-mixed"),
        "qwen2moe-attn-ckpt": dict(LONG, grad_ckpt="full"),
        # expert width 1024 beside h = 64: the peak is the experts' backward (each rank makes 1/2 of their gradients)
        "mixtral-wide": LONG, "mixtral-wide-bf16mix": dict(LONG, precision="bf16-mixed"), "qwen2moe-wide": LONG,
        "qwen2moe-wide-ckpt-bf16mix": dict(precision="bf16-mixed", grad_ckpt="full")}


def _config(name: str) -> dict:
    return CONFIGS[next(k for k in sorted(CONFIGS, key=len, reverse=True) if name.startswith(k))]


TWO = TwoRankRows(BASE, ROWS, _config, sampled=())


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_the_tp_spec_keeps_the_familys_expert_widths(family):
    """The meta inventory carries no expert widths; the TP spec takes the hand-written family's, which the MoE
    terms read (qwen2_moe's moe_intermediate_size 48 is not its dense intermediate_size 128)."""
    from llmem.plan import TrainingPlan
    from llmem.spec import ModelSpec, hf_tp_spec

    spec = ModelSpec.from_config(SUITE[family])
    tp = hf_tp_spec(spec, TrainingPlan(**{**BASE, "device": "cpu"}))
    assert tp.derived is not None and tp is not spec
    assert (tp.moe_intermediate_size, tp.shared_expert_intermediate_size) == (
        spec.moe_intermediate_size, spec.shared_expert_intermediate_size)
    assert tp.total_params == spec.total_params


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_full_fine_tuning_under_tp_is_estimated(family):
    """No refusal: one estimate, whose rank holds less than one GPU's."""
    from llmem.estimate import estimate
    from llmem.plan import TrainingPlan
    from llmem.spec import ModelSpec

    spec = ModelSpec.from_config(SUITE[family])
    two = estimate(spec, TrainingPlan(**{**BASE, "device": "cpu"}))
    one = estimate(spec, TrainingPlan(**{**BASE, "gpus": 1, "tp": 1, "device": "cpu"}))
    assert 0 < two.peak_bytes < one.peak_bytes


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("name", list(ROWS))
def test_moe_full_tp_two_ranks_within_one_percent(name):
    """The estimate against `measure` on 2 gloo ranks (max over ranks), 1 %."""
    TWO.check(name, 0.01)
