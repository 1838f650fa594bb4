"""`--activation-offload` in the estimate (`llmem.components.act_offload`): where it is modelled, and that the
offloaded bytes are reported apart from the GPU peak. The figures themselves are checked against the simulation
(tests/simulate/test_simulate_act_offload.py)."""

import pytest

from llmem.errors import GAP, REFUSED, InputError
from llmem.estimate import estimate
from llmem.plan import TrainingPlan
from llmem.presets import load_preset
from llmem.spec import ModelSpec

PLAN = dict(precision="bf16", grad_ckpt="full", activation_offload=True)


@pytest.mark.parametrize("model", ["gpt2", "gemma-2-2b",
                                   pytest.param("gemma-3-270m", marks=pytest.mark.heavy)])  # (its trace: 25 s)
def test_other_final_norms_and_outer_saves_are_a_gap_naming_the_option(model):
    """A LayerNorm (gpt2), a unit-offset RMSNorm (gemma2) or a traced architecture (gemma3_text) makes other packs
    than the llama-like program the terms follow."""
    with pytest.raises(InputError) as err:
        estimate(ModelSpec.from_config(load_preset(model)), TrainingPlan(**PLAN))
    assert err.value.field == "activation-offload" and err.value.kind == GAP


@pytest.mark.parametrize("changes, kind", [({"grad_ckpt": "none"}, REFUSED), ({"device": "cpu"}, REFUSED),
                                           ({"method": "lora"}, GAP),
                                           ({"gpus": 2, "engine": "fsdp1"}, GAP)])
def test_the_refusals_name_the_option(changes, kind):
    with pytest.raises(InputError) as err:
        TrainingPlan(**{**PLAN, **changes})
    assert err.value.field == "activation-offload" and err.value.kind == kind


def test_the_host_copies_are_apart_from_the_peak():
    """The offloaded plan's GPU peak is below the same plan's without offload by less than what went to the host
    (the final norm's packs are on both; the host also keeps the RNG states), and nothing is on the host without
    it."""
    spec = ModelSpec.from_config(load_preset("qwen2.5-0.5b"))
    on, off = estimate(spec, TrainingPlan(**PLAN, batch_size=4, seq_len=4096)), \
        estimate(spec, TrainingPlan(**{**PLAN, "activation_offload": False}, batch_size=4, seq_len=4096))
    assert off.host_bytes == 0 and on.host_bytes > 0
    assert 0 < off.peak_bytes - on.peak_bytes < on.host_bytes
    assert on.host_pinned_bytes >= on.host_bytes


def test_a_moe_model_in_half_precision_is_a_gap_and_in_fp32_estimated():
    """The simulation read a bf16 mixture-of-experts plan 1.4 % above the terms (one more tokens x hidden tensor in
    the first layer's backward, on one GPU and several), an fp32 one as without offload: bf16 is a gap."""
    from tests.measure.conftest import MIXTRAL

    spec = ModelSpec.from_config(dict(MIXTRAL))
    plan = dict(PLAN, device="cuda", batch_size=2, seq_len=64)
    with pytest.raises(InputError) as err:
        estimate(spec, TrainingPlan(**plan))
    assert err.value.field == "activation-offload" and err.value.kind == GAP
    assert estimate(spec, TrainingPlan(**{**plan, "precision": "fp32"})).peak_bytes > 0
