"""`--pp --method lora`: LoRA on pipeline stages (PEFT on the whole model, then split; gloo, CPU). Each stage's
estimated peak against the peak its rank measured (rank i runs stage i), within 1 %; the stage's trainable
parameters against the adapters the runtime's stage module holds; LoRA beside data parallelism still a gap."""

from __future__ import annotations

import pytest

from llmem.errors import InputError
from llmem.plan import TrainingPlan
from tests.components.multirank import TwoRankRows
from tests.components.test_pipeline import BASE, CONFIG, _check_stages

LORA = {**BASE, "method": "lora"}
ROWS = {  # the default suite measures one (one launch); the rest -m heavy
    "1f1b-bf16-mixed": dict(pp_schedule="1f1b", precision="bf16-mixed"),
    "gpipe-fp32": dict(pp_schedule="gpipe", precision="fp32"),
    "1f1b-fp32": dict(pp_schedule="1f1b", precision="fp32"),
    "1f1b-fp32-full": dict(pp_schedule="1f1b", precision="fp32", grad_ckpt="full"),
    "1f1b-fp32-dropout0": dict(pp_schedule="1f1b", precision="fp32", lora_dropout=0.0),
    "gpipe-bf16": dict(pp_schedule="gpipe", precision="bf16"),
    "gpipe-bf16-mixed": dict(pp_schedule="gpipe", precision="bf16-mixed"),
    "gpipe-bf16-mixed-full": dict(pp_schedule="gpipe", precision="bf16-mixed", grad_ckpt="full"),
    "1f1b-fp16-mixed-full": dict(pp_schedule="1f1b", precision="fp16-mixed", grad_ckpt="full"),
    "gpipe-fp32-qv-r8": dict(pp_schedule="gpipe", precision="fp32", lora_targets="q_proj,v_proj", lora_rank=8),
    # ScheduleInterleaved1F1B, 2 stages per rank (4 stages of 1, 2, 1, 0 layers): stages 0, 2 / 1, 3
    "interleaved-fp32": dict(pp_schedule="interleaved-1f1b", precision="fp32"),
    "interleaved-bf16-mixed": dict(pp_schedule="interleaved-1f1b", precision="bf16-mixed"),
}
# The suite's cover (tests/accuracy) measures this scheme by default; these rows under -m heavy.
RUNS = TwoRankRows(LORA, ROWS, lambda _name: dict(CONFIG), sampled=())


@pytest.mark.parametrize("name", RUNS.params())
def test_each_lora_stage_within_1_percent(name):
    RUNS.measured(name)  # its part's launch (the heavy rows: one launch of their own)
    _check_stages(RUNS, name)


@pytest.mark.parametrize("pp", [2, 3])
def test_stage_trainable_parameters_are_the_runtime_stage_adapters(pp):
    """The adapters the estimate counts on each stage (fp32: their gradients 4 bytes per trainable parameter, AdamW's
    states 8 and a 4-byte step per tensor) equal those `requires_grad` in the stage module the runtime builds from
    the PEFT model."""
    pytest.importorskip("peft")
    from llmem.components.gradients import gradient_bytes
    from llmem.components.optimizer import optimizer_state_bytes
    from llmem.components.pipeline import microbatch_plan, stage_spec
    from llmem.runtime import pipeline
    from llmem.runtime.lora import apply_method
    from llmem.runtime.model import build_model
    from llmem.spec import ModelSpec

    spec = ModelSpec.from_config(CONFIG)
    plan = TrainingPlan(gpus=pp, pp=pp, microbatches=pp, batch_size=pp, device="cpu", precision="fp32",
                        method="lora")
    model = apply_method(build_model(dict(CONFIG), plan), plan)  # PEFT on the whole model, then the split
    for stage in range(pp):
        module = pipeline.split(model, plan, stage)
        trainable = [p.numel() for p in module.parameters() if p.requires_grad]
        s, q = stage_spec(spec, plan, stage), microbatch_plan(plan)
        assert trainable and gradient_bytes(s, q) == 4 * sum(trainable), stage
        assert optimizer_state_bytes(s, q) == 8 * sum(trainable) + 4 * len(trainable), stage


@pytest.mark.parametrize("fields", [dict(method="qlora"), dict(gpus=4, microbatches=4, batch_size=4),
                                    dict(lora_modules_to_save="lm_head")])
def test_lora_beside_data_parallelism_qlora_and_module_copies_are_gaps(fields):
    with pytest.raises(InputError) as e:
        TrainingPlan(**{**LORA, "method": "lora", **fields})
    assert e.value.field in ("method", "pp-schedule", "quant")


def test_a_lora_stage_without_layers_is_refused():
    """4 layers on 4 stages: the last holds the head alone, no adapter; its optimizer would get no parameter."""
    from llmem.spec import ModelSpec

    spec = ModelSpec.from_config(CONFIG)
    with pytest.raises(InputError) as e:
        from llmem.estimate import estimate

        estimate(spec, TrainingPlan(**{**LORA, "gpus": 4, "pp": 4}))
    assert e.value.field == "pp" and "GPU 3" in str(e.value)
