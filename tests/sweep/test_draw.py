"""Random plans: deterministic for a seed, every option value drawn, every plan accepted or its refusal recorded."""

import sys

import pytest

from llmem.families import FAMILIES
from llmem.plan import (
    Attention,
    GradCkpt,
    Loss,
    Method,
    Offload,
    Optimizer,
    OptimizerImpl,
    Precision,
    Quant,
    TrainingPlan,
)
from llmem.sweep.draw import _draw_deepspeed, draw, draw_one
from llmem.sweep.models import SMALL
from llmem.sweep.run import REFUSED_ESTIMATOR, base_record, estimate_draw

MANY = 3000


@pytest.fixture(scope="module")
def many():
    return draw(MANY, seed=11)


def test_same_seed_same_plans_other_seed_other_plans():
    a, b, c = draw(40, seed=5), draw(40, seed=5), draw(40, seed=6)
    assert [(d.model, d.fields) for d in a] == [(d.model, d.fields) for d in b]
    assert [(d.model, d.fields) for d in a] != [(d.model, d.fields) for d in c]


def test_a_plan_does_not_depend_on_how_many_are_drawn():
    assert draw(12, seed=3)[9] == draw_one(3, 9, "small", "cpu")
    assert draw(4, seed=3, start=9)[0] == draw_one(3, 9, "small", "cpu")


def test_the_draw_imports_no_torch():
    import subprocess

    code = ("import sys; from llmem.sweep import draw, stats, report; draw.draw(20, 1); "
            "sys.exit('torch' in sys.modules or 'transformers' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


ENUMS = {"precision": Precision, "optimizer": Optimizer, "optimizer_impl": OptimizerImpl, "grad_ckpt": GradCkpt,
         "attn": Attention, "method": Method, "offload": Offload, "loss": Loss}


@pytest.mark.parametrize("field", sorted(ENUMS))
def test_every_enum_value_is_drawn(many, field):
    seen = {d.fields[field] for d in many}
    assert seen == {m.value for m in ENUMS[field]}


def test_every_layout_model_and_numeric_option_is_drawn(many):
    seen = lambda key: {d.fields.get(key) for d in many}  # noqa: E731
    assert {d.model for d in many} == set(SMALL)
    assert seen("gpus") == {1, 2, 3, 4} and seen("zero") == {0, 1, 2, 3} and seen("tp") == {1, 2, 3, 4}
    assert {q.value for q in Quant} - {"none"} <= seen("quant")
    assert {True, False} <= seen("double_quant")
    assert {1, 2, 3} <= seen("ckpt_every") and {1, 2, 3} <= seen("grad_accum")
    assert {"lm_head", "embed_tokens", "lm_head,embed_tokens", ""} <= seen("lora_modules_to_save")
    assert len(seen("lora_targets") - {None}) >= 6 and "all-linear" in seen("lora_targets")
    assert len(seen("lora_rank") - {None}) >= 3 and len(seen("lora_dropout") - {None}) >= 3
    assert len(seen("batch_size")) >= 3 and len(seen("seq_len")) >= 3
    assert {(d.fields["tp"], d.fields["gpus"], d.fields["zero"]) for d in many} >= {(2, 4, 3), (2, 2, 0), (4, 4, 0)}


def test_tensor_parallel_only_where_the_family_has_a_plan(many):
    tp_families = {name for name, f in FAMILIES.items() if f.tp_plan}
    drawn = {d.config["model_type"] for d in many if d.fields["tp"] > 1}
    assert drawn == tp_families & {c["model_type"] for c in SMALL.values()}


def test_the_layout_is_always_a_scheme_the_plan_accepts(many):
    for d in many:
        layout = {k: d.fields[k] for k in ("gpus", "tp", "zero")}
        TrainingPlan(**layout)  # raises if the triple is not one of DESIGN.md's schemes


def test_every_plan_is_estimated_or_its_refusal_recorded(many):
    outcomes = set()
    for d in many[:150]:
        rec = estimate_draw(d, base_record(d, 11, "small", "measure"))
        if "outcome" in rec:
            assert rec["outcome"] == REFUSED_ESTIMATOR and rec["reason"] and rec["field"]
            assert rec["reason"].startswith(rec["field"] + ":")
        else:
            assert rec["estimate_bytes"] > 0 and rec["scheme"]
        outcomes.add(rec.get("outcome", "estimated"))
    assert outcomes == {"estimated", REFUSED_ESTIMATOR}


def test_full_size_draws_every_family_on_the_cuda_profile():
    drawn = draw(600, seed=2, size="full", device="cuda")
    assert {d.model for d in drawn} == set(FAMILIES)
    assert {d.fields["device"] for d in drawn} == {"cuda"} and max(d.fields["gpus"] for d in drawn) > 4


def test_the_derived_catalogue_is_traced_and_every_lora_target_names_linears_of_its_model():
    """`--size derived`: architectures outside the hand-written families (their layers traced from transformers),
    and each LoRA target set the draw picks from matches a Linear of the model (else every LoRA draw of that
    model would only record the same refusal)."""
    from llmem.components.lora import validate
    from llmem.spec import ModelSpec
    from llmem.sweep.models import DERIVED, lora_targets

    assert DERIVED and not {c["model_type"] for c in DERIVED.values()} & set(FAMILIES)
    for config in DERIVED.values():
        spec = ModelSpec.from_config(config)
        for targets in lora_targets(config):
            validate(spec, TrainingPlan(method="lora", lora_targets=targets))


def test_derived_draws_cover_the_catalogue_and_leave_the_small_draws_alone():
    from llmem.sweep.models import DERIVED

    drawn = draw(300, seed=14, size="derived")
    assert {d.model for d in drawn} == set(DERIVED)
    assert {d.model for d in draw(300, seed=14)} <= set(SMALL)


def test_deepspeed_is_drawn_on_the_cpu_profile_where_it_is_modelled(many):
    """--engine deepspeed: ZeRO-0, 1 and 2, buckets below and at DeepSpeed's default, overlap_comm on and off under
    ZeRO-1/2 (never under ZeRO-0, which reads none), the plans' own micro-steps (ZeRO-1 overlap_comm with
    accumulation among them), LoRA in fp32 under ZeRO-0/1/2 (ZeRO-2 and overlap_comm with --lora-dropout 0), every
    such plan accepted; never on the cuda profile (the simulator does not run DeepSpeed)."""
    ds = [d for d in many if d.fields.get("engine") == "deepspeed"]
    assert {d.fields["zero"] for d in ds} == {0, 1, 2}  # (ZeRO-0: LoRA; its full plans here drew fsdp1)
    assert any(d.fields["grad_accum"] > 1 and d.fields["zero"] == 1 and d.fields["ds_overlap_comm"] for d in ds)
    lora = [d for d in ds if d.fields["method"] == "lora"]
    assert lora and all(d.fields["precision"] == "fp32" and d.fields["zero"] in (0, 1, 2) for d in lora)
    hooked = [d for d in lora if d.fields["zero"] == 2 or d.fields["ds_overlap_comm"]]
    assert hooked and all(d.fields["lora_dropout"] == 0 for d in hooked)
    assert any(d.fields["lora_dropout"] > 0 for d in lora)  # ZeRO-0/1 without overlap_comm keep their own
    base = {k: v for k, v in next(d for d in ds if d.fields["method"] == "full").fields.items() if k != "engine"}
    drawn = [_draw_deepspeed(11, i, {**base, "zero": z}, "cpu") for i in range(200) for z in (0, 1, 2)]
    assert {(x["ds_overlap_comm"], x["ds_reduce_bucket"] > 1_000_000) for x in drawn if x} == {
        (a, b) for a in (True, False) for b in (True, False)}
    zero0 = [x for i in range(200) if (x := _draw_deepspeed(11, i, {**base, "zero": 0}, "cpu"))]
    assert zero0 and not any(x["ds_overlap_comm"] for x in zero0)
    assert {d.fields["precision"] for d in ds} == {"fp32", "bf16-mixed"}
    assert len({d.fields["ds_reduce_bucket"] for d in ds}) > 2
    for d in ds:
        TrainingPlan(**d.fields)
    assert not any(d.fields.get("engine") == "deepspeed" for d in draw(300, seed=2, size="full", device="cuda"))


def test_pipeline_plans_are_drawn_with_every_schedule_and_estimated(many):
    """`--pp` in a share of the multi-GPU DDP draws of the models with a pipeline split: every schedule, each with the
    options the pipeline is modelled with, so the estimate accepts every one of them."""
    pp = [d for d in many if d.fields.get("pp", 1) > 1]
    assert {d.fields["pp_schedule"] for d in pp} == {"gpipe", "1f1b", "interleaved-1f1b"}
    assert {d.fields["zero"] for d in pp if d.fields["gpus"] > d.fields["pp"]} == {3}  # FSDP2 beside the stages
    lora = [d for d in pp if d.fields["method"] == "lora"]  # LoRA kept on one stage per GPU (`llmem.support_pp`)
    assert lora and all(d.fields["gpus"] == d.fields["pp"] for d in lora)
    for d in pp:
        rec = estimate_draw(d, base_record(d, 11, "small", "measure"))
        assert "outcome" not in rec, rec
        assert rec["estimate_bytes"] > 0


def test_lora_with_tensor_parallelism_is_drawn_where_it_runs(many):
    """A share of the LoRA plans drawn with --gpus = --tp gets the settings LoRA + TP runs with
    (`llmem.sweep.lora_tp`): the plan accepts them, with column-parallel targets (without the share: none of seed
    11's first 3,000 draws)."""
    from llmem.sweep.lora_tp import COLWISE_TARGETS

    drawn = [d for d in many if d.fields["method"] == "lora" and d.fields["tp"] > 1 and d.refusal() is None]
    assert sum(d.fields["lora_targets"] in COLWISE_TARGETS for d in drawn) >= 20


@pytest.mark.heavy
def test_lora_with_tensor_parallelism_draws_are_estimated(many):
    """The estimate answers for them (traced tables: -m heavy), but where the TP degree does not divide the heads."""
    drawn = [d for d in many if d.fields["method"] == "lora" and d.fields["tp"] > 1 and d.refusal() is None]
    estimated = set()
    for d in drawn[:12]:
        rec = estimate_draw(d, base_record(d, 11, "small", "measure"))
        if "outcome" not in rec:
            estimated.add(d.model)
        else:
            assert rec["field"] == "tp" and "must divide" in rec["reason"], rec
    assert len(estimated) >= 2


def test_pipelined_ddp_plans_put_data_parallelism_beside_the_stages_where_it_runs():
    """Of the pipelined 4-GPU DDP draws, a share gets 2 stages × 2 replicas, always 1F1B with more microbatches than
    stages (torch 2.13's Reducer asserts otherwise, `llmem.support_pp`); the plan is accepted."""
    from llmem.sweep.draw import draw_pipeline
    from llmem.sweep.models import models

    config = models("small")["llama-gqa"]
    fields = {"gpus": 4, "tp": 1, "zero": 0, "batch_size": 8, "optimizer": "adamw", "grad_ckpt": "none",
              "precision": "fp32", "attn": "eager", "device": "cpu"}
    drawn = [out for i in range(400) if (out := draw_pipeline(11, i, fields, config))]
    beside = [out for out in drawn if out["pp"] < fields["gpus"]]
    assert beside and len(beside) < len(drawn)
    for out in beside:
        assert out["pp_schedule"] == "1f1b" and out["microbatches"] > out["pp"], out
        TrainingPlan(**(fields | out))
