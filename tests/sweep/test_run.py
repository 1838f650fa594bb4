"""The sweep's loop with a stand-in oracle: one JSON line per plan as it finishes, resume, oracle outcomes."""

import json

import pytest

from llmem.sweep import run
from llmem.sweep.run import COMPARED, FAILED, REFUSED_ESTIMATOR, REFUSED_ORACLE


@pytest.fixture
def fake_measure(monkeypatch):
    """The measure oracle replaced by one that finds every estimate 2% low, or refuses model 'bloom'."""
    calls = []

    def measure_block(pending, raw, log):
        calls.append([rec["index"] for _, rec in pending])
        return [run.oracle_failure(rec, "attn: no such attention") if d.model == "bloom"
                else run.compared(rec, int(rec["estimate_bytes"] * 1.02)) for d, rec in pending]

    monkeypatch.setattr(run, "measure_block", measure_block)
    return calls


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_every_plan_is_one_line_with_its_outcome(tmp_path, fake_measure):
    out = tmp_path / "s.jsonl"
    rows = run.sweep(30, 5, "measure", "small", out, block=7, log=lambda _: None)
    written = lines(out)
    assert rows == written and sorted(r["index"] for r in written) == list(range(30))
    assert {r["outcome"] for r in written} <= {COMPARED, REFUSED_ESTIMATOR, REFUSED_ORACLE}
    assert COMPARED in {r["outcome"] for r in written} and REFUSED_ESTIMATOR in {r["outcome"] for r in written}
    for r in written:
        if r["outcome"] == COMPARED:
            assert r["error_pct"] == pytest.approx(100 * (1 / 1.02 - 1), abs=0.01)
    assert all(max(block) - min(block) < 7 for block in fake_measure)  # the oracle runs block by block


def test_resume_keeps_the_rows_and_draws_only_the_rest(tmp_path, fake_measure):
    out = tmp_path / "s.jsonl"
    first = run.sweep(12, 5, "measure", "small", out, log=lambda _: None)
    measured = sum(fake_measure, [])
    fake_measure.clear()
    both = run.sweep(30, 5, "measure", "small", out, resume=True, log=lambda _: None)
    again = sum(fake_measure, [])
    assert not set(measured) & set(again) and min(again, default=12) >= 12
    assert [r for r in both if r["index"] < 12] == first and len(both) == 30
    fresh = run.sweep(12, 5, "measure", "small", out, log=lambda _: None)  # no resume: starts over
    assert fresh == first and len(lines(out)) == 12


@pytest.mark.parametrize("message, outcome", [
    ("quant: the 8-bit base is modelled on one GPU only", REFUSED_ORACLE),
    ("RuntimeError: shapes do not match", FAILED),
    ("NotImplementedError: Linear biases under qlora are not modelled", REFUSED_ORACLE),
    ("rank 0: NotImplementedError: Operator aten._fused_sgd_.default has no sharding strategy", REFUSED_ORACLE),
    ("rank 1: ValueError: bad", FAILED),
    ("OOM: out of memory", FAILED),
    ("torchrun exited with code 1: boom", FAILED),
    ("timeout: the torchrun job did not finish", FAILED),
])
def test_an_oracle_error_is_a_refusal_or_a_failure(message, outcome):
    rec = run.oracle_failure({"id": "x"}, message)
    assert rec["outcome"] == outcome and rec["reason"] == message


def test_the_simulate_oracle_compares_or_refuses():
    """Plans 15 (llama, one GPU, AdamW), 3 (mixtral DDP, adamw8bit), 116 (mixtral ZeRO-2 with FSDP2's CPU offload,
    on the simulation's fake accelerator) and 165 (mixtral with Liger's fused linear cross-entropy) of seed 3 on the
    cuda profile: the first three simulated and compared, the fourth refused by the simulation (Triton kernels)."""
    from llmem.sweep.draw import draw_one

    out = {}
    for index in (15, 3, 116, 165):
        d = draw_one(3, index, "small", "cuda")
        rec = run.estimate_draw(d, run.base_record(d, 3, "small", "simulate"))
        out[index] = run.simulate_one(d, rec)
    assert out[15]["outcome"] == COMPARED and out[15]["oracle_bytes"] > 0
    assert out[15]["error_pct"] == pytest.approx(
        100 * (out[15]["estimate_bytes"] - out[15]["oracle_bytes"]) / out[15]["oracle_bytes"], abs=1e-4)
    assert out[3]["outcome"] == COMPARED and out[3]["oracle_bytes"] > 0
    assert out[116]["outcome"] == COMPARED and abs(out[116]["error_pct"]) < 1
    assert out[165]["outcome"] == REFUSED_ORACLE and out[165]["field"] == "loss"


def test_rows_read_back_are_classified_by_the_current_rule(tmp_path):
    out = tmp_path / "s.jsonl"
    old = [{"id": "a", "outcome": FAILED, "reason": "NotImplementedError: no such path"},
           {"id": "b", "outcome": FAILED, "reason": "RuntimeError: boom"},
           {"id": "c", "outcome": COMPARED, "error_pct": 0.1}]
    out.write_text("".join(json.dumps(r) + "\n" for r in old))
    assert [r["outcome"] for r in run.read_rows(out)] == [REFUSED_ORACLE, FAILED, COMPARED]


def test_reestimate_recomputes_the_estimate_against_the_recorded_oracle(tmp_path, fake_measure):
    out = tmp_path / "s.jsonl"
    rows = run.sweep(20, 5, "measure", "small", out, log=lambda _: None)
    # The recorded estimates are what this estimator gives: re-estimating reproduces every row.
    assert run.reestimate(rows) == rows
    # A row whose recorded estimate is off (as after a formula change) gets this estimator's figure back.
    cmp_i = next(i for i, r in enumerate(rows) if r["outcome"] == COMPARED)
    tampered = [dict(r) for r in rows]
    tampered[cmp_i] |= {"estimate_bytes": 1, "error_pct": -99.0}
    again = run.reestimate(tampered)
    assert again[cmp_i] == rows[cmp_i]
    assert [r for i, r in enumerate(again) if i != cmp_i] == [r for i, r in enumerate(rows) if i != cmp_i]


def test_reestimate_asks_a_refused_plan_again(tmp_path, fake_measure):
    rows = run.sweep(20, 5, "measure", "small", tmp_path / "s.jsonl", log=lambda _: None)
    refused = [r for r in rows if r["outcome"] == run.REFUSED_ESTIMATOR]
    assert refused and all(r["kind"] in ("refused", "gap", "input") for r in refused)
    # A refusal recorded by an earlier estimator whose plan this one accepts: accepted since, with no oracle figure.
    cmp_row = next(r for r in rows if r["outcome"] == COMPARED)
    stale = {k: v for k, v in cmp_row.items() if k not in ("estimate_bytes", "error_pct", "oracle_bytes")}
    stale |= {"outcome": run.REFUSED_ESTIMATOR, "field": "method", "reason": "method: not modelled yet"}
    (again,) = run.reestimate([stale])
    assert again["outcome"] == run.ACCEPTED_SINCE and again["estimate_bytes"] == cmp_row["estimate_bytes"]


def test_resuming_draws_again_the_plans_refused_then_and_accepted_now(tmp_path):
    """A row recorded as the estimator's refusal leaves the file on resume when this estimator accepts its plan (so
    the oracle runs it); a plan still refused keeps its row."""
    import json

    from llmem.sweep.draw import draw_one
    from llmem.sweep.run import REFUSED_ESTIMATOR, _drop_accepted_since, base_record, estimate_draw

    found = {}
    for i in range(40):  # the first accepted and the first refused plan of the seed
        d = draw_one(11, i, "small", "cpu")
        rec = estimate_draw(d, base_record(d, 11, "small", "measure"))
        found.setdefault(rec.get("outcome", "accepted"), rec)
        if len(found) == 2:
            break
    accepted, refused = found["accepted"], found[REFUSED_ESTIMATOR]
    out = tmp_path / "sweep.jsonl"
    as_refused = accepted | {"outcome": REFUSED_ESTIMATOR, "field": "method", "reason": "method: not then"}
    out.write_text("".join(json.dumps(r) + "\n" for r in (as_refused, refused)))
    again = _drop_accepted_since(out, 11, "small")
    assert [json.loads(line)["index"] for line in out.read_text().splitlines()] == [refused["index"]]
    assert list(again) == [accepted["index"]] and again[accepted["index"]].fields == accepted["plan"]


def test_resuming_runs_the_plan_as_recorded_when_the_draw_has_changed_since(tmp_path, fake_measure):
    """A plan refused then and accepted now is run as the row recorded it, not as today's draw of its index (the
    draw gains options over time, so the index may now give another plan)."""
    from llmem.sweep.draw import draw_one

    out = tmp_path / "sweep.jsonl"
    rows = run.sweep(20, 11, "measure", "small", out, log=lambda _: None)
    first = next(r for r in rows if r["outcome"] == COMPARED)
    other = next(r for r in rows if r["outcome"] == COMPARED and r["plan"] != first["plan"])
    # the row of `other`'s index recorded `first`'s plan, refused then
    stale = other | {"plan": first["plan"], "model": first["model"], "outcome": run.REFUSED_ESTIMATOR,
                     "field": "method", "reason": "method: not then"}
    out.write_text("".join(json.dumps(stale if r["index"] == other["index"] else r) + "\n" for r in rows))
    fake_measure.clear()
    resumed = run.sweep(20, 11, "measure", "small", out, resume=True, log=lambda _: None)
    assert sum(fake_measure, []) == [other["index"]]
    (row,) = [r for r in resumed if r["index"] == other["index"]]
    today = draw_one(11, other["index"], "small", "cpu").fields
    assert row["outcome"] == COMPARED and row["plan"] == first["plan"] != today


@pytest.mark.parametrize("gpus, estimate, first, again, kept", [
    (2, 900, 1000, 950, 950),    # read more than 1 % high: measured alone, the lower peak kept
    (2, 900, 1000, 1010, 1000),  # the second launch read higher: the first kept
    (2, 995, 1000, 900, 1000),   # within 1 %: not launched again
    (1, 900, 1000, 900, 1000),   # one process: no gloo threads, never launched again
])
def test_a_multi_rank_plan_read_high_is_measured_again_alone(monkeypatch, gpus, estimate, first, again, kept):
    from llmem.measure import launch
    from llmem.measure.validate import Row

    launched = []
    monkeypatch.setattr(launch, "run_job", lambda rows, world, device: launched.append(world) or (
        [{"id": rows[0]["id"], "peak_bytes": again}], ""))
    row = Row("s0-0", "llama", {"model_type": "llama"}, {"gpus": gpus} if gpus > 1 else {})
    res = run._read_high_again(row, {"estimate_bytes": estimate}, {"peak_bytes": first})
    assert res["peak_bytes"] == kept
    assert launched == ([gpus] if gpus > 1 and estimate < 0.99 * first else [])
    assert ("launch_peaks" in res) == (kept != first)
