"""The accuracy suite: every row of suite.yaml estimated and measured on CPU, each within 1 %; and the measured
bytes equal to the committed ACCURACY.md's on whatever CPU runs it (kernel scratch is left out of the measurement,
llmem/measure/kernels.py), so the table stays true on any x86-64 machine."""

import re
from pathlib import Path

import pytest
import yaml

from llmem.measure.validate import TOLERANCE_MULTI, TOLERANCE_SINGLE, Row, load_suite, validate
from tests.derive.configs import EXTRA

SUITE = Path(__file__).with_name("suite.yaml")
COMMITTED = Path(__file__).parents[2] / "ACCURACY.md"
# The table prints MiB to 3 decimals (±0.0005 MiB); DDP's unfenced C++ reducer moves a row by up to 64 B.
TABLE_RESOLUTION_MIB = 0.0005 + 64 / 2**20


def committed_measured_mib() -> dict[str, float]:
    """id -> measured MiB of every row of the committed ACCURACY.md."""
    out = {}
    for line in COMMITTED.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 13 and re.fullmatch(r"\d+\.\d{3}", cells[12]) and cells[0] != "id":
            out[cells[0]] = float(cells[12])
    return out


def test_suite_covers_the_grid():
    suite = load_suite(SUITE)
    plans = [r.training_plan("cpu") for r in suite.rows]
    assert len(suite.rows) >= 30
    assert len({r.config["model_type"] for r in suite.rows}) >= 6
    assert {p.scheme.value for p in plans} == {"single", "ddp", "zero1", "zero2", "zero3", "tp", "tp+zero3", "pp"}
    assert {p.gpus for p in plans} == {1, 2, 4}
    assert {p.precision.value for p in plans} == {"fp32", "bf16", "fp16", "bf16-mixed", "fp16-mixed"}
    assert {(p.optimizer.value, p.optimizer_impl.value) for p in plans} >= {
        ("adamw", "forloop"), ("adamw", "foreach"), ("adamw", "fused"), ("sgd", "forloop"), ("sgd", "foreach"),
        ("sgd", "fused")}
    assert {p.grad_ckpt.value for p in plans} == {"none", "full", "selective"}
    assert {p.attn.value for p in plans} == {"sdpa", "eager"}


# Sizes are not features: a row's shape is chosen for where its peak falls, not to cover a value.
_SIZES = {"batch_size", "seq_len", "lora_rank", "lora_alpha", "loss_chunks", "microbatches", "bucket_cap_mb",
          "reduce_bucket_size", "gpus", "zero", "tp"}


# Derived architectures the default run measures elsewhere: tests/derive/test_accuracy.py's default cover runs each
# family of tests/derive/configs.EXTRA once against a real CPU run (within 0.5 %), so a suite row is not measured by
# default for such a model alone (its other features still count; every row under -m heavy).
MEASURED_ELSEWHERE = frozenset(EXTRA)


def _features(row: Row) -> set:
    """What a row exercises: its model (but a derived family of MEASURED_ELSEWHERE), its engine's scheme on its
    process count, every plan field it sets (with its value), and every such field on one process and on several (an
    option under data parallelism is not the same program as on one GPU; each scheme with it is measured by the
    heavy run)."""
    plan = row.training_plan("cpu")
    scheme = plan.scheme.value if plan.gpus > 1 else "single"
    if plan.engine.value != "torch":
        scheme = f"{plan.engine.value} {scheme}"
    where = "one process" if plan.gpus == 1 else "several processes"
    out = {("scheme", scheme, plan.gpus)}
    if row.config["model_type"] not in MEASURED_ELSEWHERE:
        out.add(("model", row.model))
    for key, value in row.plan.items():
        out |= {(key, "set" if key in _SIZES else str(value)), (where, key)}
    return out


def cover(rows: list[Row]) -> list[Row]:
    """A greedy set cover of the rows' features, in suite order on ties: every model (a derived family of
    MEASURED_ELSEWHERE: in tests/derive), scheme × process count, plan value, and option on one and on several
    processes of the suite is measured by the default run; every row under `-m heavy` (and by `python -m llmem
    validate`, which regenerates ACCURACY.md)."""
    feats = {r.id: _features(r) for r in rows}
    everything, covered, chosen = set().union(*feats.values()), set(), []
    while covered != everything:
        best = max(rows, key=lambda r: (len(feats[r.id] - covered), -rows.index(r)))
        chosen.append(best)
        covered |= feats[best.id]
    return [r for r in rows if r in chosen]


def _sub_suite(tmp_path: Path, ids: set[str]) -> Path:
    """suite.yaml with only the rows named (models and defaults kept)."""
    data = yaml.safe_load(SUITE.read_text())
    data["rows"] = [r for r in data["rows"] if r["id"] in ids]
    out = tmp_path / "suite.yaml"
    out.write_text(yaml.safe_dump(data))
    return out


def _rows(part: str) -> set[str]:
    rows = load_suite(SUITE).rows
    if part != "every":
        rows = [r for r in cover(rows) if (r.training_plan("cpu").gpus == 1) == (part == "one-process")]
    return {r.id for r in rows}


def test_the_cover_measures_every_feature_of_the_suite():
    rows = load_suite(SUITE).rows
    chosen = cover(rows)
    assert set().union(*map(_features, chosen)) == set().union(*map(_features, rows))
    assert len(chosen) < len(rows)


def test_the_families_left_out_of_the_cover_are_measured_by_default_in_tests_derive():
    import importlib

    derive = importlib.import_module("tests.derive.test_accuracy")
    assert MEASURED_ELSEWHERE == {row[0] for row in derive.COVER}  # each family once in the default run
    assert all(derive._marks(row) == [] for row in derive.COVER)  # not heavy


@pytest.mark.parametrize("part", ["one-process", "several-processes",
                                  pytest.param("every", marks=pytest.mark.heavy)])
def test_estimates_within_tolerance(tmp_path, part):
    suite = _sub_suite(tmp_path, _rows(part))
    records = validate(suite, "cpu", tmp_path, accuracy_md=tmp_path / "ACCURACY.md", log=lambda _: None)
    assert (tmp_path / "validate.csv").exists() and (tmp_path / "ACCURACY.md").exists()
    failed = [f"{r['id']}: {r['message']}" for r in records if r["status"] in ("failed", "no estimate")]
    assert not failed, failed
    over = []
    for r in records:
        limit = 100 * (TOLERANCE_SINGLE if r["gpus"] == 1 else TOLERANCE_MULTI)
        if abs(r["error_pct"]) > limit:
            over.append(f"{r['id']}: {r['error_pct']:+.2f}% (estimate {r['estimated_bytes']}, "
                        f"measured {r['measured_bytes']})")
    assert not over, "\n".join(over)
    committed = committed_measured_mib()
    moved = [f"{r['id']}: measured {r['measured_bytes'] / 2**20:.4f} MiB here, {committed.get(r['id'])} MiB in "
             f"ACCURACY.md" for r in records
             if r["measured_bytes"] is not None and (r["id"] not in committed or
                                                     abs(r["measured_bytes"] / 2**20 - committed[r["id"]])
                                                     > TABLE_RESOLUTION_MIB)]
    assert not moved, "regenerate ACCURACY.md (python -m llmem validate ... --accuracy-md ACCURACY.md):\n" + \
        "\n".join(moved)


def test_committed_table_covers_the_suite():
    assert set(committed_measured_mib()) == {r.id for r in load_suite(SUITE).rows}
