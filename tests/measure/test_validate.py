"""validate: a failing row is reported and the rest of the grid still runs; bad suites name their field."""

import csv

import pytest
import yaml

from llmem.errors import InputError
from llmem.measure.validate import load_suite, validate
from tests.measure.conftest import GPT2, LLAMA


def test_failed_row_reported_rest_measured(tmp_path):
    suite = tmp_path / "s.yaml"
    suite.write_text(yaml.safe_dump({
        "models": {"llama": LLAMA, "gpt2": GPT2},
        "defaults": {"seq_len": 16, "batch_size": 1, "precision": "fp32"},
        "rows": [{"id": "ok1", "model": "llama"}, {"id": "bad", "model": "gpt2", "gpus": 2, "tp": 2},
                 {"id": "ok2", "model": "gpt2", "gpus": 2}],
    }))
    records = validate(suite, "cpu", tmp_path / "out", log=lambda _: None)
    by_id = {r["id"]: r for r in records}
    assert by_id["bad"]["status"] == "failed" and "tp" in by_id["bad"]["message"]
    assert by_id["ok1"]["measured_bytes"] > 0 and by_id["ok2"]["measured_bytes"] > 0
    with open(tmp_path / "out" / "validate.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["id"] for r in rows] == ["ok1", "bad", "ok2"]
    assert rows[2]["per_rank"].count(" ") == 1


@pytest.mark.parametrize("text,needle", [
    ("rows: [{model: x, gpus: 0}]", "gpus"),
    ("rows: [{model: x, colour: red}]", "colour"),
    ("nothing: 1", "rows"),
    ("rows: [", "suite"),
])
def test_bad_suite_names_field(tmp_path, text, needle):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(InputError) as exc:
        load_suite(path)
    assert needle in str(exc.value)

