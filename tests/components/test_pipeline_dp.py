"""`--pp` with data parallelism beside it (`--gpus` = pp × dp, torchtitan's mesh: pp outer, dp inner): DDP (`--zero
0`) or FSDP2 (`--zero 3`, torchtitan's `apply_fsdp` on each stage) over each stage's dp ranks. Each rank's measured
peak (4 ranks: pp 2 × dp 2, gloo, CPU) against its stage's estimate (rank r runs stage r // dp), within 1 %; the
combinations not modelled refused in one line."""

from __future__ import annotations

import pytest

from llmem.errors import InputError
from llmem.estimate import estimate
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from tests.components.multirank import TwoRankRows
from tests.components.test_pipeline import CONFIG

BASE = dict(gpus=4, pp=2, batch_size=4, microbatches=4, seq_len=16)
ROWS = {  # the default suite measures the FSDP2 row (one 4-rank launch, about 1-2 min on 2 loaded cores)
    "ddp-1f1b-fp32": dict(pp_schedule="1f1b", precision="fp32"),
    "fsdp-1f1b-fp32": dict(pp_schedule="1f1b", precision="fp32", zero=3),
    # the rest under -m heavy (DDP runs 1F1B with more microbatches than stages only: `llmem.support`)
    "ddp-1f1b-bf16-mixed-full": dict(pp_schedule="1f1b", precision="bf16-mixed", grad_ckpt="full"),
    "ddp-1f1b-bf16": dict(pp_schedule="1f1b", precision="bf16"),
    "ddp-1f1b-m3-fp32-full": dict(pp_schedule="1f1b", precision="fp32", grad_ckpt="full", batch_size=3,
                                  microbatches=3),
    "ddp-1f1b-bf16-mixed-seq64": dict(pp_schedule="1f1b", precision="bf16-mixed", seq_len=64),
    "ddp-1f1b-sgd-m6": dict(pp_schedule="1f1b", precision="fp32", batch_size=6, microbatches=6, optimizer="sgd"),
    "ddp-1f1b-adafactor": dict(pp_schedule="1f1b", precision="fp32", optimizer="adafactor"),
    "ddp-1f1b-eager-bf16-mixed-full": dict(pp_schedule="1f1b", precision="bf16-mixed", grad_ckpt="full",
                                           attn="eager"),
    "fsdp-1f1b-eager-fp32": dict(pp_schedule="1f1b", precision="fp32", attn="eager", zero=3),
    "fsdp-gpipe-fp32": dict(pp_schedule="gpipe", precision="fp32", zero=3),
    "fsdp-1f1b-fp32-full": dict(pp_schedule="1f1b", precision="fp32", grad_ckpt="full", zero=3),
    "fsdp-1f1b-bf16": dict(pp_schedule="1f1b", precision="bf16", zero=3),
    "fsdp-gpipe-fp32-seq64-m2": dict(pp_schedule="gpipe", precision="fp32", seq_len=64, microbatches=2, zero=3),
    "fsdp-1f1b-sgd-m2": dict(pp_schedule="1f1b", precision="fp32", batch_size=2, microbatches=2, optimizer="sgd",
                             zero=3),
}
RUNS = TwoRankRows(BASE, ROWS, lambda _name: dict(CONFIG), sampled=("fsdp-1f1b-fp32",))


# other options on the stages of a lone pipeline (2 ranks): torch.optim.Adafactor (its factored states of each
# stage's own tensors), eager attention (each stage forward's mask, `create_causal_mask`)
ON_STAGES = TwoRankRows(dict(BASE, gpus=2), {
    "adafactor-1f1b-fp32": dict(pp_schedule="1f1b", precision="fp32", optimizer="adafactor"),
    "adafactor-gpipe-bf16-mixed-full": dict(pp_schedule="gpipe", precision="bf16-mixed", grad_ckpt="full",
                                            optimizer="adafactor"),
    "adafactor-interleaved-fp32": dict(pp_schedule="interleaved-1f1b", precision="fp32", optimizer="adafactor"),
    "eager-1f1b-fp32": dict(pp_schedule="1f1b", precision="fp32", attn="eager"),
    "eager-gpipe-bf16-mixed-full": dict(pp_schedule="gpipe", precision="bf16-mixed", grad_ckpt="full", attn="eager"),
    "eager-interleaved-bf16-seq32": dict(pp_schedule="interleaved-1f1b", precision="bf16", seq_len=32, attn="eager"),
}, lambda _name: dict(CONFIG), sampled=())


@pytest.mark.heavy  # the suite's 4-rank pp x dp rows measure it by default (tests/accuracy)
@pytest.mark.parametrize("name", RUNS.params())
def test_each_rank_within_1_percent_of_its_stage(name):
    _check_ranks(RUNS, name)


@pytest.mark.parametrize("name", ON_STAGES.params())
def test_other_options_on_the_stages_within_1_percent(name):
    _check_ranks(ON_STAGES, name)


def _check_ranks(runs: TwoRankRows, name: str) -> None:
    """Rank r's measured peak against its stage's estimate (stage r // dp), within 1 %."""
    plan = runs.plan(name)
    est = estimate(ModelSpec.from_config(dict(CONFIG)), plan)
    res = runs.measured(name)[name]
    assert "error" not in res, res.get("error")
    per_rank = [est.stage_peaks[r // plan.dp] for r in range(plan.gpus)]
    if any(e < m * 0.99 for e, m in zip(per_rank, res["per_rank"], strict=True)):  # read high: once more, alone
        res = runs.remeasure(name)
    for rank, (e, m) in enumerate(zip(per_rank, res["per_rank"], strict=True)):
        assert abs(e - m) <= 0.01 * m, f"{name} rank {rank} (stage {rank // plan.dp}): estimate {e:,} vs {m:,}"


@pytest.mark.parametrize(("fields", "blame"), [
    (dict(gpus=3, pp=2), "pp"),  # not pp × dp
    (dict(gpus=4, pp=2, pp_schedule="gpipe"), "pp-schedule"),  # DDP's Reducer asserts at the next bucket rebuild
    (dict(gpus=4, pp=2, microbatches=2, batch_size=2), "pp-schedule"),  # 1F1B with M = pp: the same
    (dict(gpus=2, pp=2, zero=3), "zero"),  # FSDP2 with no data-parallel rank to shard over
    (dict(gpus=4, pp=2, zero=2), "pp"),  # ZeRO-1/2 beside the pipeline: not modelled
    (dict(gpus=4, pp=2, zero=3, precision="bf16-mixed"), "zero"),
    (dict(gpus=4, pp=2, zero=3, pp_schedule="interleaved-1f1b"), "zero"),
    (dict(gpus=4, pp=2, zero=3, pp_schedule="gpipe", microbatches=1), "zero"),  # read -0.6 to -2.1 %: not modelled
])
def test_combinations_not_modelled_are_refused_naming_the_field(fields, blame):
    with pytest.raises(InputError) as err:
        TrainingPlan(**{"batch_size": 4, "microbatches": 4, "device": "cpu", **fields})
    assert err.value.field == blame

