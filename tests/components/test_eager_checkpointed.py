"""Checkpointed layers with eager attention: estimate against a real CPU run (counting allocator) of one rank, and
of two FSDP2 ranks (gloo) for the FSDP2 walk's same moments on the compute plan.

What these plans exercise: the eager causal mask the checkpoint keeps for the recompute
(`activations.eager_mask_held_saved`), the attention core's backward (`attention_core`: the softmax backward beside
the recomputed probabilities, also under LoRA), gemma2's post-feedforward norm backward (`norm_backward`), and the
MLP moment's gradients (gelu MLPs: one intermediate-sized gradient; the last MLP Linear's weight gradient, which
for phi3 is smaller than its fused gate_up_proj). Found by the random sweep: -13.5% (qwen3 LoRA), -9.3% (opt pure
bf16) before. Bound: the 1% of the accuracy suite (measured: within 0.1%, phi3 within 0.8%)."""

import pytest

from llmem.estimate import estimate
from llmem.measure.run import measure_rank
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from llmem.sweep.models import SMALL
from tests.components.multirank import TwoRankRows

TOLERANCE = 0.01
LORA_QV = dict(method="lora", lora_rank=4, lora_alpha=8, lora_dropout=0.1, lora_targets="q_proj,v_proj")
CASES = {
    "llama-gqa-fp32": ("llama-gqa", dict(batch_size=2, seq_len=128, precision="fp32")),
    "llama-gqa-bf16-lora": ("llama-gqa", dict(batch_size=2, seq_len=128, precision="bf16", **LORA_QV)),
    "qwen3-bf16-mixed": ("qwen3", dict(batch_size=2, seq_len=128, precision="bf16-mixed")),
    "qwen3-bf16-mixed-lora-accum": ("qwen3", dict(batch_size=4, seq_len=128, precision="bf16-mixed", grad_accum=2,
                                                  optimizer_impl="foreach", **LORA_QV)),
    "opt-bf16": ("opt", dict(batch_size=2, seq_len=128, precision="bf16")),
    "gpt2-fp16-mixed": ("gpt2", dict(batch_size=2, seq_len=128, precision="fp16-mixed")),
    "gpt_neox-fp32": ("gpt_neox", dict(batch_size=2, seq_len=128, precision="fp32")),
    "gemma2-bf16": ("gemma2", dict(batch_size=2, seq_len=128, precision="bf16")),
    "phi3-bf16-mixed": ("phi3", dict(batch_size=2, seq_len=128, precision="bf16-mixed")),
    "bloom-bf16-mixed": ("bloom", dict(batch_size=2, seq_len=128, precision="bf16-mixed")),
    "mixtral-fp32": ("mixtral", dict(batch_size=2, seq_len=128, precision="fp32")),
}


@pytest.mark.parametrize("name", CASES)
def test_checkpointed_eager_within_one_percent(name):
    model, fields = CASES[name]
    plan = TrainingPlan(**fields, grad_ckpt="full", attn="eager", device="cpu")
    measured = measure_rank(SMALL[model], plan)["peak_bytes"]
    est = estimate(ModelSpec.from_config(SMALL[model]), plan)
    assert abs(est.peak_bytes - measured) <= TOLERANCE * measured, \
        f"{est.peak_bytes:,} vs {measured:,} ({est.peak_phase})"


FSDP_ROWS = {
    "opt-bf16-zero3": dict(model="opt", zero=3, precision="bf16"),
    "llama-gqa-bf16-mixed-zero2": dict(model="llama-gqa", zero=2, precision="bf16-mixed"),
    "gemma2-bf16-zero3": dict(model="gemma2", zero=3, precision="bf16"),  # two masks; the post-feedforward norm
    "gpt_neox-fp16-mixed-zero2": dict(model="gpt_neox", zero=2, precision="fp16-mixed"),
}
FSDP = TwoRankRows(dict(gpus=2, batch_size=2, seq_len=128, grad_ckpt="full", attn="eager"),
                   {n: {k: v for k, v in r.items() if k != "model"} for n, r in FSDP_ROWS.items()},
                   lambda name: SMALL[FSDP_ROWS[name]["model"]])


@pytest.mark.parametrize("name", FSDP_ROWS)
def test_checkpointed_eager_fsdp_two_ranks_within_one_percent(name):
    """Measured within 0.04% (opt -9.9%, gpt_neox -9.7%, gemma2 -5.3%, llama -3.5% before)."""
    FSDP.check(name, tolerance=TOLERANCE)


@pytest.mark.parametrize("precision", ["fp16-mixed", "bf16"])
def test_bloom_recompute_holds_its_attention_locals_at_the_residual_add(precision):
    """Seed 12's s12-2304 (bloom fp16-mixed checkpointed, ZeRO-1, grad-accum 2: -1.40 %): `BloomAttention.forward`
    runs the residual add itself, so in a checkpointed layer's recompute its locals (the norm output, fused_qkv,
    baddbmm's scores and their fp32 sum with the mask) are alive beside the recomputed saves there
    (`attention_core.recompute_locals_bytes`). This plan with SGD: fp16-mixed -1.51 % -> -0.12 %; pure bf16 (half
    locals, below the MLP moment) +0.04 % either way. Bound 1 % as above (what is left: 8 KiB, not pinned down)."""
    cfg = SMALL["bloom"]
    plan = TrainingPlan(device="cpu", batch_size=4, seq_len=128, precision=precision, grad_ckpt="full",
                        optimizer="sgd", grad_accum=2)
    est = estimate(ModelSpec.from_config(cfg), plan).peak_bytes
    measured = measure_rank(cfg, plan)["peak_bytes"]
    print(f"{precision}: estimate {est:,} measured {measured:,} ({(est - measured) / measured:+.3%})")
    assert abs(est - measured) <= TOLERANCE * measured, (est, measured)
