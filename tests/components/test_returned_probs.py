"""Falcon's and BLOOM's decoder layers return their eager attention probabilities, which the model's loop keeps beside
the next layer's forward; with every layer checkpointed nothing else holds them, and the last layer's softmax beside
them can be the iteration's peak (`llmem.components.returned_probs`). Estimates against real CPU runs (the counting
allocator), one rank, DDP and FSDP2 ZeRO-3 on 2 ranks; before the moment these read 5.4 to 16.3 % low. Where it is not
modelled (--ckpt-every K > 1, selective checkpointing) the plan is a gap naming --grad-ckpt."""

import pytest

from llmem.errors import InputError
from llmem.estimate import estimate
from llmem.measure.run import measure_rank
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from tests.components.multirank import TwoRankRows

FALCON = {"model_type": "falcon", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "vocab_size": 64, "new_decoder_architecture": False, "multi_query": True, "parallel_attn": True,
          "bias": False}
BLOOM = {"model_type": "bloom", "hidden_size": 64, "n_layer": 2, "n_head": 4, "vocab_size": 64}
CONFIGS = {"falcon": FALCON, "bloom": BLOOM}
TOLERANCE = 0.005  # the single-rank bar of the component tests
CASES = {  # the first runs by default
    "falcon-fp32-1x256": dict(batch_size=1, seq_len=256, precision="fp32"),
    "falcon-fp32-4x128": dict(batch_size=4, seq_len=128, precision="fp32"),
    "falcon-bf16-1x512": dict(batch_size=1, seq_len=512, precision="bf16"),
    "falcon-bf16-mixed-4x128": dict(batch_size=4, seq_len=128, precision="bf16-mixed"),
    "falcon-lora-bf16-1x512": dict(batch_size=1, seq_len=512, precision="bf16", method="lora"),
    "falcon-lora-fp32-4x128": dict(batch_size=4, seq_len=128, precision="fp32", method="lora"),
    "bloom-bf16-1x512": dict(batch_size=1, seq_len=512, precision="bf16"),
    "bloom-lora-bf16-1x512": dict(batch_size=1, seq_len=512, precision="bf16", method="lora"),
    "bloom-bf16-mixed-4x128": dict(batch_size=4, seq_len=128, precision="bf16-mixed"),
}


def _plan(fields: dict) -> TrainingPlan:
    return TrainingPlan(**fields, attn="eager", grad_ckpt="full", device="cpu")


@pytest.mark.parametrize("name", [n if k == 0 else pytest.param(n, marks=pytest.mark.heavy)
                                  for k, n in enumerate(CASES)])
def test_checkpointed_layers_returned_probabilities_within_half_a_percent(name):
    config = CONFIGS[name.split("-")[0]]
    plan = _plan(CASES[name])
    measured = measure_rank(config, plan)["peak_bytes"]
    est = estimate(ModelSpec.from_config(config), plan)
    assert abs(est.peak_bytes - measured) <= TOLERANCE * measured, (est.peak_phase, est.peak_bytes, measured)


ROWS = TwoRankRows(
    {"gpus": 2, "zero": 3, "attn": "eager", "grad_ckpt": "full"},
    {"falcon-zero3-fp32-4x128": dict(batch_size=4, seq_len=128, precision="fp32"),
     "bloom-zero3-bf16-1x512": dict(batch_size=1, seq_len=512, precision="bf16"),
     "falcon-ddp-bf16-1x512": dict(zero=0, batch_size=1, seq_len=512, precision="bf16")},
    lambda name: CONFIGS[name.split("-")[0]], sampled=[])


@pytest.mark.heavy
@pytest.mark.parametrize("name", list(ROWS.rows))
def test_two_ranks_within_one_percent(name):
    ROWS.check(name, tolerance=0.01)


@pytest.mark.parametrize("model_type,fields", [("falcon", {"ckpt_every": 2}), ("bloom", {"ckpt_every": 2}),
                                               ("falcon", {"grad_ckpt": "selective"})])
def test_unmodelled_checkpointing_is_a_gap_naming_grad_ckpt(model_type, fields):
    """Measured -13.7 % (falcon) and -7.7 % (BLOOM) at 1 x 512 bf16 with --ckpt-every 2, -13.4 % falcon selective:
    refused, not estimated low; falcon under sdpa returns no probabilities and stays estimated."""
    plan = TrainingPlan(**{"attn": "eager", "grad_ckpt": "full", "device": "cpu", **fields})
    with pytest.raises(InputError) as err:
        estimate(ModelSpec.from_config(CONFIGS[model_type]), plan)
    assert err.value.field == "grad-ckpt" and err.value.gap
    if model_type == "falcon":
        assert estimate(ModelSpec.from_config(FALCON), plan.with_(attn="sdpa")).peak_bytes > 0
