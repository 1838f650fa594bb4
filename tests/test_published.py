"""Published GPU measurements (tests/data/published_measurements.csv): the rows `llmem.published` claims to model,
estimate vs measured. Fails when the median absolute error of the claimed rows exceeds `published.BOUND` (10 %,
justified in docs/PUBLISHED.md). `pytest -s` prints the table."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from llmem import published
from llmem.choices import Engine
from llmem.plan import Method
from llmem.presets import load_preset
from llmem.spec import ModelSpec

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def rows():
    return published.load_rows()


@pytest.fixture(scope="module")
def results(rows):
    return published.claimed_results(rows)


def test_every_claim_names_a_row_and_matches_its_columns(rows):
    by_id = {r["id"]: r for r in rows}
    assert set(published.CLAIMS) | set(published.REFERENCE) <= set(by_id)
    assert not set(published.CLAIMS) & set(published.REFERENCE)
    for rid, claim in {**published.CLAIMS, **published.REFERENCE}.items():
        row = by_id[rid]
        plan = published.row_plan(row, claim)
        assert plan.gpus == int(row["gpus"])
        stage = row["zero_stage"].lower().replace("_", " ")
        assert (plan.zero == 3) == ("full" in stage or re.fullmatch(r"fsdp2 \(\d+-way\)", stage) is not None), rid
        ran_fsdp1 = stage.startswith("fsdp ") or "fsdp1" in row["framework"].lower()
        if rid in published.CLAIMS:
            assert (plan.engine is Engine.FSDP1) == ran_fsdp1, rid
        else:  # shown for reference: adapters under FSDP1, which --engine fsdp1 does not model
            assert ran_fsdp1 and plan.method is not Method.FULL, rid
        assert str(plan.batch_size) == row["batch_size_per_gpu"].strip()
        assert str(plan.seq_len) in row["seq_len"]
        assert row["scheme"].startswith(plan.method.value), rid  # "full (pre-training)" is a full training step
        if plan.method is not Method.FULL:
            assert plan.lora_rank == int(row["lora_rank"])
        if plan.method is Method.QLORA:
            assert plan.quant.value in row["quant"]
        assert row["notes"].startswith(("TIER_A", "TIER_B"))
        assert "unit_ambiguous" not in row["notes"]
        stat = row["measured_metric"].lower()
        assert (claim.statistic == published.ALLOCATED) == ("allocated" in stat), rid


def test_claims_cover_full_lora_and_qlora(results):
    assert {r.plan.method for r in results} == {Method.FULL, Method.LORA, Method.QLORA}


def test_every_other_row_has_a_reason(rows):
    for row in rows:
        if row["id"] not in published.CLAIMS:
            assert published.unclaimed_reason(row)


def test_median_error_of_claimed_rows_within_bound(results):
    print()
    print(f"{'id':<30}{'source':<24}{'method':<7}{'statistic':<10}{'measured GB':>12}{'estimated GB':>13}{'error':>9}")
    for r in results:
        print(f"{r.id:<30}{r.source:<24}{r.method:<7}{r.statistic:<10}{r.measured_bytes / 1e9:>12.2f}"
              f"{r.estimated_bytes / 1e9:>13.2f}{r.error * 100:>8.1f}%")
    for source, (n, med, mean) in published.per_source(results).items():
        print(f"  {source:<28} rows {n}  median |error| {med * 100:.1f} %  mean error {mean * 100:+.1f} %")
    median = published.median_abs_error(results)
    print(f"median |error| of {len(results)} claimed rows: {median * 100:.1f} % (bound {published.BOUND * 100:.0f} %)")
    assert median <= published.BOUND


def test_published_doc_is_generated_and_current():
    spec = importlib.util.spec_from_file_location("gen_published_table", ROOT / "scripts" / "gen_published_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (ROOT / "docs" / "PUBLISHED.md").read_text() == published.render_markdown(), (
        "docs/PUBLISHED.md is stale: run python scripts/gen_published_table.py")


def test_fsdp1_reference_rows_are_shown_but_not_in_the_median(rows, results):
    reference = published.reference_results(rows)
    assert {r.id for r in reference} == set(published.REFERENCE)
    assert not {r.id for r in reference} & {r.id for r in results}
    doc = published.render_markdown(rows)
    assert all(f"| {rid} |" in doc for rid in published.REFERENCE)


def test_config_overrides_change_no_shape():
    """A claim's config override names how the source's own code computes a layer, never a size: the model it
    builds has the preset's parameter count."""
    overridden = {rid: c for rid, c in {**published.CLAIMS, **published.REFERENCE}.items() if c.config}
    assert overridden
    for rid, claim in overridden.items():
        base = load_preset(claim.preset)
        assert set(claim.config) <= set(base), rid
        assert (ModelSpec.from_config({**base, **claim.config}).total_params
                == ModelSpec.from_config(base).total_params), rid


def test_per_scheme_groups_the_claimed_rows(results):
    groups = published.per_scheme(results)
    assert sum(n for n, _, _ in groups.values()) == len(results)
    assert {published.SINGLE, published.FSDP1} <= set(groups)
    fsdp1 = [r for r in results if published.scheme_group(r.plan) == published.FSDP1]
    assert fsdp1 and all(r.plan.engine is Engine.FSDP1 and r.plan.gpus > 1 for r in fsdp1)
    n, med, mean = groups[published.FSDP1]
    assert n == len(fsdp1) and mean == sum(r.error for r in fsdp1) / n
    doc = published.render_markdown()
    assert "## Per scheme" in doc and f"| {published.FSDP1} | {n} |" in doc
