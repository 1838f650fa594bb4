"""`python -m llmem sweep`: bad arguments exit 2 with one line naming the field; --report renders a page."""

import json

import pytest

from llmem.cli import main
from tests.sweep.test_stats import ROWS


@pytest.mark.parametrize("argv, field", [
    (["--random", "0"], "random"),
    (["--random", "many"], "random"),
    (["--random", "-3"], "random"),
    ([], "random"),
    (["--random", "2", "--seed", "x"], "seed"),
    (["--random", "2", "--oracle", "guess"], "oracle"),
    (["--random", "2", "--size", "huge"], "size"),
    (["--random", "2", "--size", "full"], "size"),  # the measure oracle is CPU-only
    (["--random", "2", "--block", "0"], "block"),
    (["--report", "--out", "nowhere/none.jsonl", "--markdown", "x.md"], "out"),
    (["--random", "2", "--reestimate"], "reestimate"),  # re-estimating re-renders an earlier sweep's rows
])
def test_bad_arguments_exit_2_naming_the_field(argv, field, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["sweep", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"llmem: error: {field}:"), err


def test_sweep_is_in_the_help(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "sweep" in capsys.readouterr().out


def test_report_renders_the_rows_of_a_file(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    md = tmp_path / "docs" / "SWEEP.md"
    assert main(["sweep", "--report", "--out", str(out), "--markdown", str(md)]) == 0
    page = md.read_text()
    assert page.startswith("# Sweep") and "| compared | 5 | 50.0% |" in page
    assert f"python -m llmem sweep --report --out {out} --markdown {md}" in page
    assert "| compared | 5 |" in capsys.readouterr().out
