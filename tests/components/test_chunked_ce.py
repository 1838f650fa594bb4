"""`--loss chunked-ce` (torchtune's CEWithChunkedOutputLoss, eager): real CPU runs with the chunked loss and with the
standard one — one GPU in fp32, pure bf16 and bf16-mixed, checkpointed, LoRA, N = 1 and 4 chunks (and 8, where the
lm_head's summed chunk weight gradients are the peak), and with -m heavy gpt2's traced LoRA and FSDP2 ZeRO-3 (fp32,
bf16-mixed), DDP and llama's TP on 2 ranks (one launch): the estimate within 1% of each, and the saving it predicts
against the standard loss is the one measured, to 1% of the peak; two chunks, where the sum of their weight
gradients comes after the lm_head's nodes are gone."""

from __future__ import annotations

import pytest

from llmem.components import chunked_ce
from llmem.estimate import estimate
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from tests.components.multirank import TwoRankRows
from tests.measure.conftest import GPT2, LLAMA

CONFIGS = {"llama": LLAMA, "gpt2": GPT2}
SMALL_VOCAB = {**LLAMA, "vocab_size": 64}  # a loss too small to be the peak
QLORA_FSDP = {"gpus": 2, "zero": 3, "method": "qlora", "quant": "nf4", "precision": "bf16"}
BASE = {"batch_size": 2, "seq_len": 64, "precision": "fp32"}
SINGLE = {"fp32": {}, "bf16": {"precision": "bf16"}, "bf16-mixed": {"precision": "bf16-mixed"},
          "ckpt": {"grad_ckpt": "full"}, "lora-bf16-mixed": {"method": "lora", "precision": "bf16-mixed"},
          "lora-ckpt": {"method": "lora", "grad_ckpt": "full"}, "b1-uneven": {"batch_size": 1, "seq_len": 61},
          # PEFT's trained lm_head copy runs the chunks: weight gradients and one cached cast, as full fine-tuning
          "lora-head-copy": {"method": "lora", "lora_modules_to_save": "lm_head"},
          "lora-copies-bf16-mixed": {"method": "lora", "lora_modules_to_save": "lm_head,wte",
                                     "precision": "bf16-mixed"}}
GPT2_ONLY = ("lora-copies-bf16-mixed",)  # (gpt2's embedding is wte)
CHUNKED = {"loss": "chunked-ce"}
MULTI = {"zero3": {"zero": 3}, "zero3-bf16-mixed": {"zero": 3, "precision": "bf16-mixed"}, "ddp": {"zero": 0},
         "tp-bf16-mixed": {"tp": 2, "precision": "bf16-mixed"}}  # TP: llama's hand-written plan (gpt2 has none)
MULTI_CASES = [(m, p) for m in CONFIGS for p in MULTI if not (m == "gpt2" and p.startswith("tp"))]
ROWS = TwoRankRows(  # one 2-rank launch (-m heavy, as the project's 2-rank launches: ~30-80 s on 2 busy cores)
    {**BASE, "gpus": 2},
    {f"{m}-{p}-{loss}": {**MULTI[p], "loss": loss, **({"loss_chunks": 4} if loss == "chunked-ce" else {})}
     for m, p in MULTI_CASES for loss in ("standard", "chunked-ce")} | {"small-vocab-qlora-zero3": QLORA_FSDP},
    lambda name: SMALL_VOCAB if name.startswith("small-vocab") else CONFIGS[name.split("-", 1)[0]])
TRACED = pytest.mark.heavy  # gpt2's LoRA is traced (`llmem.derive.lora`): seconds per estimate


def _estimate(model: str, plan: TrainingPlan) -> int:
    return estimate(ModelSpec.from_config(CONFIGS[model]), plan).peak_bytes


def _saving_matches(est: dict, measured: dict, standard: str, chunked: str) -> None:
    saved_est, saved_measured = est[standard] - est[chunked], measured[standard] - measured[chunked]
    assert saved_measured >= 0
    assert abs(saved_est - saved_measured) <= 0.01 * measured[chunked], (saved_est, saved_measured)


@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize("model,case", [pytest.param(m, c, marks=TRACED) if (m, c[:4]) == ("gpt2", "lora") else (m, c)
                                        for m in CONFIGS for c in SINGLE if c not in GPT2_ONLY or m == "gpt2"])
def test_one_gpu_estimate_and_saving_match_real_runs(model, case, chunks):
    from llmem.measure.run import measure_rank

    est, measured = {}, {}
    for loss, extra in (("standard", {}), ("chunked", {**CHUNKED, "loss_chunks": chunks})):
        plan = TrainingPlan(**{**BASE, **SINGLE[case], **extra}, device="cpu")
        est[loss], measured[loss] = _estimate(model, plan), measure_rank(CONFIGS[model], plan)["peak_bytes"]
        assert abs(est[loss] - measured[loss]) <= 0.01 * measured[loss], (loss, est[loss], measured[loss])
    _saving_matches(est, measured, "standard", "chunked")


def test_the_summed_chunk_weight_gradients_can_be_the_peak():
    """With 8 chunks of this small model the lm_head's first out-of-place sum of two chunk weight gradients (with
    the logits gradients of the chunks below) is above the loss: the estimate names that moment and meets the run."""
    from llmem.measure.run import measure_rank

    plan = TrainingPlan(**BASE, **CHUNKED, loss_chunks=8, device="cpu")
    est = estimate(ModelSpec.from_config(LLAMA), plan)
    measured = measure_rank(LLAMA, plan)["peak_bytes"]
    assert est.peak_phase == "lm_head backward"
    assert abs(est.peak_bytes - measured) <= 0.01 * measured, (est.peak_bytes, measured)


def test_chunks_can_cost_more_than_the_standard_loss():
    """Few tokens against the hidden size (16 × 3 tokens, h = 64): the lm_head's summed chunk weight gradients (two more
    V × h copies) outweigh the logits the chunks save; the estimate says chunked-ce costs more, by what is measured."""
    from llmem.measure.run import measure_rank

    est, measured = {}, {}
    for loss, extra in (("standard", {}), ("chunked", {**CHUNKED, "loss_chunks": 8})):
        plan = TrainingPlan(**{**BASE, "batch_size": 3, "seq_len": 16, **extra}, device="cpu")
        est[loss], measured[loss] = _estimate("gpt2", plan), measure_rank(GPT2, plan)["peak_bytes"]
    assert measured["chunked"] > measured["standard"] and est["chunked"] > est["standard"]
    grown_est, grown_measured = est["chunked"] - est["standard"], measured["chunked"] - measured["standard"]
    assert abs(grown_est - grown_measured) <= 0.01 * measured["chunked"], (grown_est, grown_measured)


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_two_chunks_free_what_the_lm_head_saved_before_their_weight_gradients_are_summed(precision):
    """Seed 15's s15-48 (+1.51 %): with two chunks the out-of-place sum of their weight gradients comes after the last
    chunk's MmBackward0, which released autocast's half weight copy (bf16-mixed: +3.2 % before, the peak is now chunk
    0's weight gradient beside chunk 1's) and, at batch 1 in fp32, the final norm output both chunks viewed; the
    lm_head's gradient is then a fresh tensor, so a tied embedding's gradient is added into it in place (fp32: no
    out-of-place tied sum, +0.71 % before). Bound 0.2 %: the walk holds every tensor of these moments; what is left
    (184 bytes, 0.01 %) is the loss's scalars."""
    from llmem.measure.run import measure_rank
    from llmem.sweep.models import SMALL

    config = SMALL["llama-mha-tied"]
    plan = TrainingPlan(batch_size=1, seq_len=32, precision=precision, optimizer="sgd", **CHUNKED, loss_chunks=2,
                        device="cpu")
    est = estimate(ModelSpec.from_config(config), plan).peak_bytes
    measured = measure_rank(config, plan)["peak_bytes"]
    print(f"{precision}: estimate {est:,} measured {measured:,} ({(est - measured) / measured:+.3%})")
    assert abs(est - measured) <= 0.002 * measured, (est, measured)


@pytest.mark.heavy
@pytest.mark.parametrize("model,plan", MULTI_CASES)
def test_two_ranks_estimate_and_saving_match_real_runs(model, plan):
    standard, chunked = f"{model}-{plan}-standard", f"{model}-{plan}-chunked-ce"
    ROWS.check(standard, tolerance=0.01)
    ROWS.check(chunked, tolerance=0.01)
    est = {n: _estimate(model, ROWS.plan(n)) for n in (standard, chunked)}
    _saving_matches(est, {n: ROWS.measured()[n]["peak_bytes"] for n in (standard, chunked)}, standard, chunked)


@pytest.mark.parametrize("seq,chunks", [(64, 8), (61, 4), (5, 4), (3, 8), (7, 1)])
def test_chunk_sizes_are_torchs(seq, chunks):
    import torch

    plan = TrainingPlan(batch_size=2, seq_len=seq, loss="chunked-ce", loss_chunks=chunks)
    expected = [2 * c.shape[1] for c in torch.empty(2, seq).chunk(chunks, dim=1)]
    assert chunked_ce.chunk_tokens(plan) == expected


@pytest.mark.heavy
@pytest.mark.xfail(strict=True, reason="QLoRA under FSDP2 ZeRO-3 with a loss too small to peak: the 4-bit layers' "
                   "forward measures 6.0% above the walk with the standard loss (why chunked-ce + qlora + FSDP2 is a "
                   "gap in llmem.support)")
def test_qlora_fsdp_forward_without_a_dominant_loss():
    ROWS.check("small-vocab-qlora-zero3", tolerance=0.01)

