"""TrainingPlan validation: every bad value is an InputError naming the field."""

import pytest

from llmem.errors import InputError
from llmem.plan import OptimizerImpl, Scheme, TrainingPlan


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"batch_size": 0}, "batch-size"),
        ({"batch_size": -3}, "batch-size"),
        ({"seq_len": 0}, "seq-len"),
        ({"seq_len": "long"}, "seq-len"),
        ({"gpus": 0}, "gpus"),
        ({"gpus": True}, "gpus"),
        ({"gpus": 4, "tp": 3}, "tp"),
        ({"gpus": 2, "zero": 4}, "zero"),
        ({"gpus": 1, "zero": 3}, "zero"),
        ({"gpus": 4, "tp": 4, "zero": 1}, "zero"),
        ({"gpus": 8, "tp": 2, "zero": 1}, "zero"),
        ({"precision": "fp8"}, "precision"),
        ({"optimizer": "lion"}, "optimizer"),
        ({"optimizer_impl": "cuda"}, "optimizer-impl"),
        ({"attn": "flash"}, "attn"),
        ({"device": "tpu"}, "device"),
        ({"batch_size": 1 << 20, "seq_len": 1 << 20}, "batch-size"),
    ],
)
def test_bad_plans_name_the_field(kwargs, field):
    with pytest.raises(InputError) as e:
        TrainingPlan(**kwargs)
    assert e.value.field == field


@pytest.mark.parametrize(
    "gpus,tp,zero,scheme",
    [(1, 1, 0, Scheme.SINGLE), (2, 1, 0, Scheme.DDP), (2, 1, 1, Scheme.ZERO1), (4, 1, 2, Scheme.ZERO2),
     (4, 1, 3, Scheme.ZERO3), (4, 4, 0, Scheme.TP), (8, 2, 3, Scheme.TP_ZERO3)],
)
def test_scheme_follows_the_design_table(gpus, tp, zero, scheme):
    assert TrainingPlan(gpus=gpus, tp=tp, zero=zero).scheme is scheme


def test_strings_from_the_command_line_are_parsed():
    plan = TrainingPlan(gpus="8", tp="2", zero="3", batch_size="4", precision="BF16-mixed")
    assert (plan.gpus, plan.tp, plan.zero, plan.batch_size, plan.dp) == (8, 2, 3, 4, 4)


def test_default_optimizer_implementation_depends_on_the_device():
    assert TrainingPlan(device="cuda").effective_optimizer_impl is OptimizerImpl.FOREACH
    assert TrainingPlan(device="cpu").effective_optimizer_impl is OptimizerImpl.FORLOOP
    assert TrainingPlan(device="cpu", optimizer_impl="fused").effective_optimizer_impl is OptimizerImpl.FUSED
