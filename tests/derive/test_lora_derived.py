"""LoRA with tables traced from the PEFT model (`llmem.derive.lora`): derived architectures and the hand-written
families without a hand-written LoRA table. The adapters' counts against PEFT on the meta device, the refusals (one
line naming the field), and the estimate against a real CPU run within 1%: two plans in the default suite, the grid
(families × one rank / DDP on 2 ranks × sdpa / eager × the attention projections / all-linear ×
checkpointing none / full; ZeRO-1/2/3 on 2 ranks for three families): every seventh one-rank cell and every fifth
two-rank row in the default suite, all of them with `-m heavy`."""

from __future__ import annotations

import itertools

import pytest

from llmem.components import lora
from llmem.errors import InputError
from llmem.estimate import estimate
from llmem.measure.run import measure_rank
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from llmem.sweep.models import SMALL
from tests.components.multirank import TwoRankRows
from tests.components.test_activations import CONFIGS
from tests.components.test_lora import peft_model_on_meta
from tests.derive.configs import config

TOLERANCE = 0.01
DERIVED = ("phi", "starcoder2", "olmo2", "granite", "stablelm")
HAND_WRITTEN = ("gpt2", "opt", "bloom", "falcon", "gpt_neox", "phi3", "gemma2")
# a family's attention projections as PEFT names them (fused where the family fuses them)
ATTENTION = {"gpt2": "c_attn", "bloom": "query_key_value", "falcon": "query_key_value",
             "gpt_neox": "query_key_value", "phi3": "qkv_proj"}


def config_of(family: str) -> dict:
    return CONFIGS[family] if family in CONFIGS else config(family)


def targets(family: str, kind: str) -> str:
    return "all-linear" if kind == "all" else ATTENTION.get(family, "q_proj,v_proj")


def _error(family: str, **plan) -> float:
    cfg = config_of(family)
    p = TrainingPlan(device="cpu", method="lora", **plan)
    est = estimate(ModelSpec.from_config(cfg), p)
    assert est.spec.derived is not None  # the traced tables answered
    measured = measure_rank(cfg, p)["peak_bytes"]
    print(f"{family} {plan}: estimate {est.peak_bytes:,} measured {measured:,} "
          f"({(est.peak_bytes - measured) / measured:+.3%}, {est.peak_phase})")
    return (est.peak_bytes - measured) / measured


@pytest.mark.parametrize("family, kind", list(itertools.product(DERIVED, ["attention", "all"]))
                         + [("bloom", "attention"), ("opt", "all"), ("gemma2", "all")])
def test_adapter_counts_equal_peft_on_meta(family, kind):
    """The adapters' parameters (and so their gradients and optimizer states) of the traced families' Linears."""
    plan = TrainingPlan(method="lora", lora_rank=8, lora_targets=targets(family, kind))
    trainable, total = peft_model_on_meta(config_of(family), plan).get_nb_trainable_parameters()
    spec = ModelSpec.from_config(config_of(family))
    assert (lora.trainable_params(spec, plan), lora.total_params(spec, plan)) == (trainable, total)


@pytest.mark.parametrize("family, plan, field", [
    ("gpt_oss", dict(lora_targets="all-linear", attn="eager", grad_ckpt="full"), "lora-targets"),  # no PEFT rewrite
    ("qwen3_moe", dict(lora_targets="all-linear", lora_dropout=0.05), "lora-dropout"),  # PEFT's ParamWrapper refuses
    ("glm4_moe", dict(lora_targets="up_proj,down_proj", lora_dropout=0.0), "lora-targets"),  # half of gate_up_proj
    ("qwen3_moe", dict(lora_targets="q_proj,gate_proj,up_proj", lora_dropout=0.0, tp=2, gpus=2), "tp"),  # the
    # fused experts adapted under TP: not measured (attention targets are: tests/derive/test_tp_moe_lora.py)
    ("deepseek_v3", dict(lora_targets="gate_proj"), "lora-targets"),  # PEFT maps MLP names onto the fused experts
    ("mixtral", dict(), "lora-dropout"),  # hand-written: all-linear's ParamWrapper on the experts refuses dropout
])
def test_what_is_not_traced_is_refused_naming_the_field(family, plan, field):
    cfg = config_of(family)
    p = TrainingPlan(**{"method": "lora", "precision": "fp32", "seq_len": 64, **plan})
    with pytest.raises(InputError) as err:
        estimate(ModelSpec.from_config(cfg), p)
    text = str(err.value)
    assert text.startswith(f"{field}: ") and "\n" not in text, text


def test_hand_written_lora_families_keep_their_tables():
    spec = ModelSpec.from_config(CONFIGS["llama"])
    assert estimate(spec, TrainingPlan(method="lora", precision="fp32")).spec.derived is None


@pytest.mark.parametrize("family, plan", [
    ("phi", dict(batch_size=2, seq_len=64, precision="fp32", grad_ckpt="full")),
    ("gpt2", dict(batch_size=2, seq_len=64, precision="fp32", attn="eager", lora_targets="c_attn",
                  grad_ckpt="full")),
])
def test_traced_lora_within_one_percent(family, plan):
    assert abs(_error(family, **plan)) <= TOLERANCE


# LoRA on derived mixture-of-experts models (frozen grouped_mm experts; `llmem.derive.lora.moe_refusal`): measured
# qwen3_moe q,v fp32 -0.057 %, deepseek_v3 o_proj,kv_b_proj eager -0.045 %, olmoe attention bf16-mixed -0.035 %,
# gpt_oss attention bf16-mixed checkpointed -0.036 %, qwen3_moe q,v bf16 checkpointed -0.115 % (before the forward
# in flight was a moment, gpt_oss q,v unchecked read -3.2 %: `Derived.forward_inflight_extra_bytes`)
@pytest.mark.parametrize("family, plan", [
    pytest.param("qwen3_moe", dict(lora_targets="q_proj,v_proj"), marks=pytest.mark.heavy),  # suite: s-qwen3moe-*
    pytest.param("deepseek_v3", dict(lora_targets="o_proj,kv_b_proj", attn="eager"), marks=pytest.mark.heavy),
    pytest.param("olmoe", dict(lora_targets="q_proj,k_proj,v_proj,o_proj", precision="bf16-mixed"),
                 marks=pytest.mark.heavy),
    pytest.param("gpt_oss", dict(lora_targets="q_proj,k_proj,v_proj,o_proj", attn="eager", precision="bf16-mixed",
                                 grad_ckpt="full"), marks=pytest.mark.heavy),
    pytest.param("qwen3_moe", dict(lora_targets="q_proj,v_proj", precision="bf16", grad_ckpt="full",
                                   lora_dropout=0.0), marks=pytest.mark.heavy),
    # the last layer's forward in flight beside the unsaved `inputs_embeds` (-1.1 % before it was counted)
    pytest.param("gpt_oss", dict(lora_targets="q_proj,v_proj", attn="eager"), marks=pytest.mark.heavy),
    # ... under autocast, with the weight copies as made (`windows.inflight_window`; -0.85 % before: refused)
    pytest.param("gpt_oss", dict(lora_targets="q_proj,v_proj", attn="eager", precision="bf16-mixed"),
                 marks=pytest.mark.heavy),
])
def test_traced_lora_on_derived_moe_within_one_percent(family, plan):
    assert abs(_error(family, **{"batch_size": 2, "seq_len": 64, "precision": "fp32", **plan})) <= TOLERANCE


@pytest.mark.parametrize("targets", ["qkv_proj", "o_proj"])
def test_checkpointed_recompute_under_autocast_frees_the_frozen_weight_copies(targets):
    """Seed 15's s15-73 (phi3 LoRA fp16-mixed, eager, checkpointed: +2.42 %; +3.0 % and +3.3 % for these plans): in a
    checkpointed layer's recompute, autocast's copies of the frozen Linears after the attention core (o_proj,
    gate_up_proj, down_proj; not cached: they are not leaves that require grad) are saved by their mm alone and go
    with its MmBackward0, before the core's softmax backward peaks. The trace kept every copy made in backward alive
    to its end (with qkv_proj 57,344 bytes, exactly those three copies). Bound 1 %: what is left is -0.06 %."""
    cfg = SMALL["phi3"]
    p = TrainingPlan(device="cpu", method="lora", batch_size=1, seq_len=128, precision="fp16-mixed", attn="eager",
                     grad_ckpt="full", lora_targets=targets, lora_dropout=0.0, optimizer="sgd")
    est = estimate(ModelSpec.from_config(cfg), p).peak_bytes
    measured = measure_rank(cfg, p)["peak_bytes"]
    print(f"{targets}: estimate {est:,} measured {measured:,} ({(est - measured) / measured:+.3%})")
    assert abs(est - measured) <= TOLERANCE * measured, (est, measured)


GRID = list(itertools.product(DERIVED + HAND_WRITTEN, ["sdpa", "eager"], ["attention", "all"], ["none", "full"]))


def _sampled(cells: list, every: int) -> list:
    """Every `every`-th cell in the default suite (each family, attention and checkpointing seen), the rest heavy."""
    return [c if i % every == 0 else pytest.param(*c, marks=pytest.mark.heavy) for i, c in enumerate(cells)]


@pytest.mark.slow
@pytest.mark.parametrize("family, attn, kind, ckpt", _sampled(GRID, 7))
def test_traced_lora_grid_one_rank(family, attn, kind, ckpt):
    assert abs(_error(family, batch_size=2, seq_len=64, precision="fp32", attn=attn,
                      lora_targets=targets(family, kind), grad_ckpt=ckpt)) <= TOLERANCE


@pytest.mark.heavy
@pytest.mark.parametrize("family, plan", [
    *[(f, dict(precision=p, grad_ckpt=c)) for f in ("starcoder2", "granite", "falcon") for c in ("none", "full")
      for p in ("bf16", "bf16-mixed")],
    *[(f, dict(precision="bf16-mixed", attn="eager", lora_targets=targets(f, "attention"), grad_ckpt=c))
      for f in ("phi", "gpt2") for c in ("none", "full")],
    ("phi3", dict(precision="fp32", lora_modules_to_save="lm_head,embed_tokens")),
    ("olmo2", dict(precision="fp32", lora_modules_to_save="embed_tokens", grad_ckpt="full")),
    ("gpt_neox", dict(precision="fp32", batch_size=1, seq_len=96)),
])
def test_traced_lora_options_one_rank(family, plan):
    assert abs(_error(family, **{"batch_size": 2, "seq_len": 64, **plan})) <= TOLERANCE


_FAMILIES_2 = ("phi", "granite", "gpt2", "falcon")
ROWS = {f"{f}-{attn}-{kind}-{ckpt}": dict(attn=attn, lora_targets=targets(f, kind), grad_ckpt=ckpt)
        for f, attn, kind, ckpt in itertools.product(_FAMILIES_2, ["sdpa", "eager"], ["attention", "all"],
                                                     ["none", "full"])}
ROWS |= {f"{f}-zero{z}-{ckpt}": dict(zero=z, grad_ckpt=ckpt) for f in ("starcoder2", "gpt_neox", "gpt2")
         for z in (1, 2, 3) for ckpt in ("none", "full")}
ROWS |= {f"{f}-mixed-zero{z}-{ckpt}": dict(zero=z, grad_ckpt=ckpt, precision="bf16-mixed") for f in ("phi", "gpt2")
         for z in (0, 1) for ckpt in ("none", "full")}
SAMPLE = sorted(ROWS)[::5]
_BASE = dict(gpus=2, method="lora", precision="fp32", batch_size=2, seq_len=64)
TWO = TwoRankRows(_BASE, {n: ROWS[n] for n in SAMPLE}, lambda name: config_of(name.split("-")[0]))
TWO_ALL = TwoRankRows(_BASE, {n: ROWS[n] for n in ROWS if n not in SAMPLE}, TWO.config_of)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n if n in SAMPLE else pytest.param(n, marks=pytest.mark.heavy) for n in sorted(ROWS)])
def test_traced_lora_two_ranks(name):
    rows = TWO if name in SAMPLE else TWO_ALL
    est = estimate(ModelSpec.from_config(rows.config_of(name)), rows.plan(name))
    res = rows.measured(name)[name]
    assert "error" not in res, res.get("error")
    error = (est.peak_bytes - res["peak_bytes"]) / res["peak_bytes"]
    print(f"{name}: estimate {est.peak_bytes:,} measured {res['peak_bytes']:,} ({error:+.3%}, {est.peak_phase})")
    assert abs(error) <= TOLERANCE


FALCON_FSDP = TwoRankRows(dict(_BASE, zero=3, precision="fp16", grad_ckpt="full", optimizer="sgd", batch_size=4,
                               seq_len=128, lora_rank=4, lora_dropout=0.0),
                          {"falcon-fp16-zero3-mlp": dict(lora_targets="dense_h_to_4h,dense_4h_to_h")},
                          lambda name: SMALL["falcon"])


@pytest.mark.heavy
def test_traced_falcon_lora_under_fsdp2_has_no_full_fine_tuning_attention_moment():
    """Seed 15's s15-533: falcon's math-path attention-core moment is full fine-tuning's (its weight gradients and
    freed tensors); under traced LoRA the layer's window already holds that backward (as in the one-GPU walk). With
    it the estimate read +7.9 %; without, -0.72 % (DDP of the same plan: -0.73 %)."""
    name = "falcon-fp16-zero3-mlp"
    est = estimate(ModelSpec.from_config(SMALL["falcon"]), FALCON_FSDP.plan(name)).peak_bytes
    measured = FALCON_FSDP.measured()[name]["peak_bytes"]
    assert abs(est - measured) <= 0.01 * measured, (est, measured)


# --ckpt-every K > 1: the uncheckpointed layers looked up by their own index in the tables without checkpointing
# (`activations.varied`); looked up as layer 0 they read 3-6 % low (seed 12's s12-2876: -5.2 %, s12-1103: -2.1 %).
EVERY = [("phi3", dict(precision="fp16", batch_size=1, seq_len=32, lora_targets="gate_up_proj,down_proj",
                       lora_modules_to_save="lm_head", grad_accum=2, optimizer="adafactor")),
         pytest.param("gpt2", dict(batch_size=4, seq_len=128, lora_targets="c_attn", lora_dropout=0.1),
                      marks=pytest.mark.heavy),
         pytest.param("olmo2", dict(precision="bf16-mixed", attn="eager", lora_targets="all-linear", ckpt_every=3,
                                    cfg=dict(num_hidden_layers=4)), marks=pytest.mark.heavy),
         pytest.param("granite", dict(precision="fp16", lora_targets="all-linear"), marks=pytest.mark.heavy)]


@pytest.mark.slow
@pytest.mark.parametrize("family, plan", EVERY)
def test_traced_lora_checkpointing_every_kth_layer_one_rank(family, plan):
    plan = {"precision": "fp32", "batch_size": 2, "seq_len": 64, "grad_ckpt": "full", "ckpt_every": 2, **plan}
    if "cfg" in plan:  # more layers than the small config's two
        cfg = config(family, **plan.pop("cfg"))
        p = TrainingPlan(device="cpu", method="lora", **plan)
        est, measured = estimate(ModelSpec.from_config(cfg), p).peak_bytes, measure_rank(cfg, p)["peak_bytes"]
        assert abs(est - measured) <= TOLERANCE * measured, (est, measured)
    else:
        assert abs(_error(family, **plan)) <= TOLERANCE


EVERY_TWO = TwoRankRows(dict(_BASE, grad_ckpt="full", ckpt_every=2),
                        {"starcoder2-every2-zero0": dict(zero=0), "starcoder2-every2-zero3": dict(zero=3),
                         "gpt2-every2-zero1": dict(zero=1, precision="fp16-mixed", attn="eager")},
                        lambda name: config_of(name.split("-")[0]), sampled=[])  # `-m heavy`: the suite's 12 minutes


@pytest.mark.slow
@pytest.mark.parametrize("name", EVERY_TWO.params())
def test_traced_lora_checkpointing_every_kth_layer_two_ranks(name):
    EVERY_TWO.check(name, TOLERANCE)


# FSDP2 with bf16-/fp16-mixed: the MixedPrecisionPolicy all-gathers the fp32 adapters cast to half, so the tables are
# traced with half adapters (`Derived.with_half_adapters`); with fp32-adapter tables olmo2's row read +21 %.
MIXED_FSDP = TwoRankRows(dict(_BASE, precision="bf16-mixed", zero=3), {
    "olmo2-mixed-zero3-all-dropout-ckpt": dict(grad_ckpt="full", lora_targets="all-linear", lora_dropout=0.1),
    "starcoder2-mixed-zero3": dict(),
    "gpt2-mixed-zero3-eager-ckpt": dict(precision="fp16-mixed", attn="eager", lora_targets="c_attn", grad_ckpt="full"),
    "falcon-mixed-zero2-all": dict(zero=2, lora_targets="all-linear"),
    "granite-mixed-zero3-every2": dict(grad_ckpt="full", ckpt_every=2, attn="eager", lora_dropout=0.05),
    "gpt_neox-mixed-zero3-all-ckpt": dict(precision="fp16-mixed", lora_targets="all-linear", grad_ckpt="full"),
}, lambda name: config_of(name.split("-")[0]), sampled=[])  # the suite's d2-olmo2-derived-lora-zero3-bf16mix-ckpt


@pytest.mark.slow
@pytest.mark.parametrize("name", MIXED_FSDP.params())
def test_traced_lora_under_fsdp2_mixed_precision_two_ranks(name):
    MIXED_FSDP.check(name, TOLERANCE)



@pytest.mark.parametrize("ckpt", ["none", "full"])
def test_half_adapter_tables_trace_the_checkpointed_program_only_when_the_plan_checkpoints(ckpt, monkeypatch):
    """FSDP2 mixed precision tags the LoRA key "half adapters" after `trace_key`'s checkpointing flag; the
    checkpointed program (its layer-backward windows) is built and traced for checkpointed plans alone (the
    tracing itself stubbed: what is asked of it is the point)."""
    from llmem.derive import Derived, experts
    from llmem.derive import lora as derive_lora

    built = []
    monkeypatch.setattr(Derived, "_shallower", lambda self: (self.config, None))
    monkeypatch.setattr(Derived, "_build",
                        lambda self, *a, checkpointed=False, **k: (built.append(checkpointed), None, [], None))
    monkeypatch.setattr(Derived, "_fit", lambda self, *a: {"layer_kinds": [0]})
    monkeypatch.setattr(Derived, "_traces", lambda self, *a: ([], []))
    monkeypatch.setattr(experts, "check_grouped", lambda *a: None)
    monkeypatch.setattr(derive_lora, "checkpointed_windows", lambda *a: [])
    plan = TrainingPlan(device="cpu", method="lora", gpus=2, zero=3, precision="bf16-mixed", grad_ckpt=ckpt)
    assert lora.half_adapters(plan)
    derived = Derived(config("olmo2"), "olmo2").with_half_adapters()
    key = derived.key(plan)
    assert key[-1][-1] == "half adapters"
    fits = derived._trace_and_fit(key)
    assert built == ([False, True] if ckpt == "full" else [False])
    assert ("checkpointed backward" in fits) == (ckpt == "full")


# The last layer's forward in flight with a vocabulary as small as the hidden size (sweep s21-22): the decoder's
# `inputs_embeds`, which no op of layer 0 saves under LoRA, and the step's input_ids, which the frozen embedding does
# not save, are alive beside it (`trace_live.unsaved_locals`): falcon -1.99 % -> -0.007 %, all-linear -1.27 % ->
# -0.003 %, gpt_neox all-linear bf16 -0.91 % -> -0.001 %.
@pytest.mark.heavy
@pytest.mark.parametrize("family, plan", [
    ("falcon", dict(lora_targets="query_key_value", precision="fp16")),
    ("falcon", dict(lora_targets="all-linear", precision="fp16")),
    ("gpt_neox", dict(lora_targets="all-linear", precision="bf16")),
])
def test_traced_lora_forward_in_flight_with_a_tiny_vocabulary(family, plan):
    from llmem.sweep.tiny_vocab import with_vocab

    cfg = with_vocab(SMALL[family], SMALL[family]["hidden_size"])
    p = TrainingPlan(device="cpu", method="lora", batch_size=4, seq_len=128, optimizer="sgd", attn="eager",
                     lora_rank=16, lora_alpha=32, lora_dropout=0.0, **plan)
    est = estimate(ModelSpec.from_config(cfg), p)
    measured = measure_rank(cfg, p)["peak_bytes"]
    assert est.peak_phase.startswith("forward (last layer, in flight)")
    assert abs(est.peak_bytes - measured) / measured <= TOLERANCE


def _tiny_vocab_falcon(_name: str) -> dict:
    from llmem.sweep.tiny_vocab import with_vocab

    return with_vocab(SMALL["falcon"], SMALL["falcon"]["hidden_size"])


FALCON_INFLIGHT = TwoRankRows(dict(gpus=2, method="lora", precision="fp16", optimizer="sgd", attn="eager", batch_size=4,
                                   seq_len=128, lora_rank=16, lora_alpha=32, lora_dropout=0.0,
                                   lora_targets="query_key_value"),
                              {"falcon-v64-zero2": dict(zero=2), "falcon-v64-zero3": dict(zero=3)}, _tiny_vocab_falcon,
                              sampled=("falcon-v64-zero2", "falcon-v64-zero3"))  # one launch (the test is heavy)


@pytest.mark.heavy
@pytest.mark.parametrize("name", list(FALCON_INFLIGHT.rows))
def test_traced_lora_forward_in_flight_under_fsdp2(name):
    """The FSDP2 walk's last layer's forward in flight from the traced tables (it had only the hand-written
    families' `decoder_locals`): ZeRO-3 -6.85 % -> -0.003 %, ZeRO-2 -0.003 %."""
    est = estimate(ModelSpec.from_config(_tiny_vocab_falcon(name)), FALCON_INFLIGHT.plan(name))
    measured = FALCON_INFLIGHT.measured()[name]["peak_bytes"]
    assert est.peak_phase == "forward (last layer, in flight)"
    assert abs(est.peak_bytes - measured) <= TOLERANCE * measured, (est.peak_bytes, measured)


@pytest.mark.heavy
def test_biogpt_without_no_split_modules_within_one_percent():
    """BioGPT declares no `_no_split_modules` (transformers 5.23): its decoder layers are found as transformers'
    `GradientCheckpointingLayer`s (`llmem.runtime.model.decoder_layers`), and its traced LoRA estimate holds."""
    cfg = {"model_type": "biogpt", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "vocab_size": 256, "max_position_embeddings": 256}
    p = TrainingPlan(device="cpu", method="lora", batch_size=4, seq_len=128)
    measured = measure_rank(cfg, p)["peak_bytes"]
    assert abs(estimate(ModelSpec.from_config(cfg), p).peak_bytes - measured) <= TOLERANCE * measured
