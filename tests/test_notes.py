"""Notes on an estimate: FSDP2's dim-0 padding of tensors with fewer rows than data-parallel ranks; MoE routing."""

import math

import pytest

from llmem.estimate import estimate
from llmem.plan import TrainingPlan
from llmem.presets import load_preset
from llmem.spec import ModelSpec

MIXTRAL = ModelSpec.from_config(load_preset("mixtral-8x7b"))
LLAMA = ModelSpec.from_config(load_preset("llama-3.1-8b"))


def padding(est) -> tuple[str, ...]:
    return tuple(n for n in est.notes if n.startswith("FSDP2 pads"))


def test_the_mixtral_peak_rises_past_8_gpus_and_the_note_says_why():
    """The rise is the estimator's own (per-rank shards stop shrinking at 8 rows); the note must appear exactly
    where the stacked expert tensors have fewer rows than ranks, and name one of them."""
    experts = {p.shape[0] for p in MIXTRAL.params if "experts" in p.name}
    assert experts == {8}
    peaks = {g: estimate(MIXTRAL, TrainingPlan(gpus=g, zero=3)) for g in (8, 16, 64)}
    assert peaks[64].peak_bytes > peaks[8].peak_bytes
    assert padding(peaks[8]) == ()
    for g in (16, 64):
        (note,) = padding(peaks[g])
        named = next(p for p in MIXTRAL.params if p.name in note)
        assert named.shape[0] < g and f"{g} data-parallel GPUs" in note and "Shard(1)" in note
    assert peaks[64].to_dict()["notes"] == list(peaks[64].notes)


@pytest.mark.parametrize("gpus,zero", [(64, 3), (8, 2), (1, 0), (8, 1)])
def test_a_dense_model_gets_no_padding_note(gpus, zero):
    assert padding(estimate(LLAMA, TrainingPlan(gpus=gpus, zero=zero))) == ()


def test_the_note_reports_the_padding_it_counts():
    """The percentage in the note is the gathered padded size over the exact size, computed here from the shapes."""
    (note,) = padding(estimate(MIXTRAL, TrainingPlan(gpus=64, zero=3)))
    exact = sum(p.numel for p in MIXTRAL.params)
    padded = sum(math.ceil(p.shape[0] / 64) * 64 * math.prod(p.shape[1:]) for p in MIXTRAL.params)
    assert f"adds {(padded - exact) / exact:.0%}" in note


def test_compare_prints_the_padding_note_once(capsys):
    from llmem.cli import main

    assert main(["compare", "--model", "mixtral-8x7b", "--gpus", "64"]) == 0
    out = capsys.readouterr().out
    assert out.count("note: FSDP2 pads dim 0") == 1
    assert main(["compare", "--model", "mixtral-8x7b", "--gpus", "64", "--fsdp-shard", "dim1-if-short"]) == 0
    assert "FSDP2 pads dim 0" not in capsys.readouterr().out


@pytest.mark.parametrize("plan", [TrainingPlan(), TrainingPlan(gpus=8, zero=3),
                                  TrainingPlan(gpus=4, zero=2, precision="bf16-mixed")])
def test_moe_estimates_say_routing_moves_nothing_and_give_a_one_point_range(plan):
    moe, dense = estimate(MIXTRAL, plan), estimate(LLAMA, plan)
    (note,) = [n for n in moe.notes if n.startswith("Mixture of experts")]
    assert "2 of 8 experts" in note
    assert not [n for n in dense.notes if n.startswith("Mixture of experts")]
    for est in (moe, dense):
        assert est.peak_bytes_range == (est.peak_bytes, est.peak_bytes)
        assert est.to_dict()["peak_bytes_range"] == [est.peak_bytes, est.peak_bytes]


def test_no_fsdp2_padding_note_under_fsdp1():
    """FSDP1 flattens each unit and pads only its end to the GPUs (`flat_param.flatten`): the stacked experts that
    FSDP2 pads per tensor cost nothing extra there, so the FSDP2 note does not apply."""
    from llmem.components import flat_param as fp
    from llmem.notes import fsdp_padding_note
    from llmem.plan import TrainingPlan
    from llmem.spec import ModelSpec
    from llmem.sweep.models import models

    spec = ModelSpec.from_config(models("small")["mixtral"])
    plan = TrainingPlan(gpus=8, zero=3)
    assert fsdp_padding_note(spec, plan) is not None
    fsdp1 = plan.with_(engine="fsdp1")
    assert fsdp_padding_note(spec, fsdp1) is None
    real = sum(p.numel for p in spec.params)
    assert sum(u.numel for u in fp.units(spec, fsdp1)) < real * 1.05  # alignment and end padding only


def test_the_reserved_order_note_names_fsdp2_rows_whose_high_end_reads_low():
    """llama-3.1-8b ZeRO-3 with eager attention (a plan the request stream does not write out, so its high end is
    the category rules', which read 10.3 % below simulate's replay on the sdpa plan, docs/notes/2026-11-27-reserved-
    agreement.md) gets the note; the sdpa plans, now replayed (within 0.4 %, docs/notes/2026-11-27-fsdp2-request-
    stream.md), the same plan with expandable segments (modelled within 2.1 %), one GPU, and a ZeRO-3 plan with no
    oversize root request do not."""
    from llmem.estimate import estimate
    from llmem.plan import TrainingPlan
    from llmem.presets import load_preset
    from llmem.spec import ModelSpec

    def has_note(preset, **plan):
        est = estimate(ModelSpec.from_config(load_preset(preset)), TrainingPlan(precision="bf16-mixed", **plan))
        return any("Reserved memory under FSDP2" in n for n in est.notes)

    assert has_note("llama-3.1-8b", gpus=8, zero=3, attn="eager")
    assert has_note("llama-3.1-8b", gpus=8, tp=2, zero=3, attn="eager")
    assert not has_note("llama-3.1-8b", gpus=8, zero=3)
    assert not has_note("llama-3.1-8b", gpus=8, tp=2, zero=3)
    assert not has_note("llama-3.1-8b", gpus=8, zero=3, attn="eager", alloc_conf="expandable-segments")
    assert not has_note("llama-3.1-8b")
    assert not has_note("qwen2.5-1.5b", gpus=8, zero=3)


def test_qlora_on_a_mixture_of_experts_says_the_experts_stay_unquantized():
    """Mixtral 8x7B's config: 32 layers × 8 experts × 3 matrices of 4096 × 14336, the fused 3-D stacks
    transformers' bitsandbytes replacement leaves in the load dtype (not nn.Linears)."""
    from llmem.notes import plan_notes

    cfg = load_preset("mixtral-8x7b")
    experts = cfg["num_hidden_layers"] * cfg["num_local_experts"] * 3 * cfg["hidden_size"] * cfg["intermediate_size"]
    (note,) = [n for n in plan_notes(MIXTRAL, TrainingPlan(method="qlora", quant="nf4", precision="bf16"))
               if n.startswith("QLoRA")]
    assert f"{experts / 1e9:.2f} B parameters" in note and "bfloat16" in note
    assert f"{experts * 2 / 2**30:.2f} GiB" in note
    assert not [n for n in plan_notes(MIXTRAL, TrainingPlan(method="lora")) if n.startswith("QLoRA")]
    assert not [n for n in plan_notes(LLAMA, TrainingPlan(method="qlora", quant="nf4")) if n.startswith("QLoRA")]
