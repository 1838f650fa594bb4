"""--loss fused-linear-ce (Liger-Kernel's fused linear cross-entropy). Liger's kernels are Triton (CUDA): nothing
can be measured on this machine, so these tests check the modelled bytes' structure against the standard walk."""

import pytest

from llmem.components import Category, fused_ce
from llmem.components import logits as lg
from llmem.errors import InputError
from llmem.estimate import estimate
from llmem.plan import TrainingPlan
from llmem.presets import load_preset
from llmem.spec import ModelSpec

FUSED = "fused-linear-ce"


def spec_with(vocab=None, name="llama-3.2-1b-instruct"):
    config = dict(load_preset(name))
    if vocab:
        config["vocab_size"] = vocab
    return ModelSpec.from_config(config)


def test_chunk_rule_follows_liger():
    """inc_factor = ceil(V/H); chunk = next power of two of ceil(T/inc_factor), at most T."""
    spec = spec_with()  # V = 128256, H = 2048: inc_factor 63
    plan = TrainingPlan(batch_size=2, seq_len=2048)
    assert fused_ce.chunk_rows(spec, plan) == 128  # ceil(4096 / 63) = 66 -> 128
    assert fused_ce.chunk_rows(spec, TrainingPlan(batch_size=1, seq_len=16)) == 1
    small_vocab = spec_with(vocab=2000)  # inc_factor 1: one chunk of all tokens
    assert fused_ce.chunk_rows(small_vocab, plan) == 4096


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16"])
def test_no_logits_survive_the_loss(precision):
    """Standard keeps the model output's logits through backward and the step; fused keeps none."""
    spec = spec_with()
    std = {p.name: p for p in estimate(spec, TrainingPlan(precision=precision)).phases}
    fused = {p.name: p for p in estimate(spec, TrainingPlan(precision=precision, loss=FUSED)).phases}
    # standard under autocast has one more moment: the lm_head's half weight gradient cast to fp32
    assert std.keys() - {"lm_head backward, weight gradient cast to fp32"} == fused.keys()
    for name in ("backward (last layer)", "backward (first layer)", "backward end", "optimizer step"):
        assert std[name].breakdown[Category.LOGITS] == lg.logits_bytes(spec, TrainingPlan(precision=precision))
        assert fused[name].breakdown[Category.LOGITS] == 0
        # everything else is the same program
        for cat in Category:
            if cat is not Category.LOGITS:
                assert std[name].breakdown[cat] == fused[name].breakdown[cat], (name, cat)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16"])
def test_loss_forward_grows_with_vocab_only_through_the_weight_gradient_and_one_chunk(precision):
    """Standard: the loss forward grows by tokens × ΔV × (cb + 4 + 4 upcast); fused: by ΔV × h × pb (grad_weight)
    plus one chunk's logits — the token count no longer multiplies the vocabulary."""
    plan = TrainingPlan(precision=precision, batch_size=4, seq_len=4096)
    a, b = spec_with(vocab=64000), spec_with(vocab=128000)  # inc_factor 32 and 63: chunk 512 and 256 rows
    fa, fb = fused_ce.loss_forward_peak_bytes(a, plan), fused_ce.loss_forward_peak_bytes(b, plan)
    dv = 64000
    chunk_growth = (fused_ce.chunk_rows(b, plan) * 128000 - fused_ce.chunk_rows(a, plan) * 64000) \
        * plan.precision.compute_bytes
    assert fb - fa == dv * a.hidden_size * plan.precision.param_bytes + chunk_growth
    sa, sb = lg.loss_forward_peak_bytes(a, plan), lg.loss_forward_peak_bytes(b, plan)
    assert sb - sa > 10 * (fb - fa)


def test_fp32_weight_gradient_fallback_allocates_a_weight_sized_temporary():
    """fp32 takes Liger's legacy path (`torch.mm(...).float()`): the chunk moment holds one more V×h fp32."""
    spec = spec_with()
    plan = TrainingPlan(precision="fp32", seq_len=512)
    rows = fused_ce.chunk_rows(spec, plan)
    assert fused_ce.chunk_peak_bytes(spec, plan) == rows * spec.vocab_size * 4 + spec.vocab_size * spec.hidden_size * 4


def test_loss_moments_replace_exactly_the_logits_terms():
    """At the loss backward, standard holds logits + 3 fp32 logits-sized tensors; fused the saved grad_input and
    grad_weight; at the lm_head backward fused holds grad_input where standard holds logits and their gradient."""
    spec = spec_with()
    plan = TrainingPlan(loss=FUSED, seq_len=1024)
    est = {p.name: p for p in estimate(spec, plan).phases}
    tokens, h, v = 1024, spec.hidden_size, spec.vocab_size
    assert est["loss backward"].breakdown[Category.LOGITS] == tokens * h * 4 + v * h * 4  # fp32 under mixed
    assert est["lm_head backward"].breakdown[Category.LOGITS] == tokens * h * 4
    std = {p.name: p for p in estimate(spec, plan.with_(loss="standard")).phases}
    # the lm_head weight gradient's half-precision copy is gone (Liger accumulates in the fp32 .grad)
    assert std["lm_head backward"].breakdown[Category.TEMPORARIES] - est["lm_head backward"].breakdown[
        Category.TEMPORARIES] == v * h * 2
    assert estimate(spec, plan).peak_bytes < estimate(spec, plan.with_(loss="standard")).peak_bytes


@pytest.mark.parametrize("kw, needle", [
    (dict(loss=FUSED, device="cpu"), "CUDA"),
    (dict(loss=FUSED, gpus=4, zero=3), "FSDP2"),
    (dict(loss=FUSED, gpus=4, tp=4), "FSDP2"),
    (dict(loss=FUSED, method="lora"), "--method full"),
])
def test_unmodelled_combinations_are_rejected(kw, needle):
    with pytest.raises(InputError) as err:
        TrainingPlan(**kw)
    assert err.value.field == "loss" and needle in str(err.value)


def test_family_without_a_liger_patch_is_rejected():
    with pytest.raises(InputError) as err:
        estimate(spec_with(name="gpt2"), TrainingPlan(loss=FUSED))
    assert err.value.field == "loss"
    assert estimate(spec_with(), TrainingPlan(loss=FUSED, gpus=2)).peak_bytes > 0  # DDP is modelled
