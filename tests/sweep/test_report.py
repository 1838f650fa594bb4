"""The sweep's markdown page, from synthetic rows."""

from llmem.sweep import report
from tests.sweep.test_stats import ROWS, row


def tables(page: str) -> list[list[str]]:
    out, current = [], []
    for line in page.splitlines():
        if line.startswith("|"):
            current.append(line)
        elif current:
            out.append(current)
            current = []
    return out + ([current] if current else [])


def test_page_has_every_section_and_well_formed_tables():
    page = report.markdown(ROWS, "python -m llmem sweep --random 10 --seed 0")
    for heading in ("## Outcomes", "## Error distribution", "## Per option", "## The 15 worst plans",
                    "## Refusals and failures, by reason"):
        assert heading in page
    assert "`python -m llmem sweep --random 10 --seed 0`" in page
    for table in tables(page):
        widths = {line.count("|") for line in table}
        assert len(widths) == 1, table


def test_page_figures():
    page = report.markdown(ROWS, "cmd")
    assert "| ±0.5% | 40.0% |" in page and "| ±1% | 60.0% |" in page and "| ±2% | 80.0% |" in page
    assert "| compared | 5 | 50.0% |" in page and "| refused by estimator | 3 | 30.0% |" in page
    assert "| refused | tp: TP degree N must divide the GPU count N | 2 | s0-5 |" in page
    assert "| — right refusals (the real program cannot run) | 2 | 20.0% |" in page
    assert "Signed: from -3.000% to +1.500%" in page


def test_worst_plans_in_order_with_the_full_plan():
    page = report.markdown(ROWS, "cmd")
    worst = page.split("## The 15 worst plans", 1)[1].split("##", 1)[0]
    ids = [line.split("|")[1].strip() for line in worst.splitlines() if line.startswith("| s0-")]
    assert ids == ["s0-3", "s0-2", "s0-1", "s0-0", "s0-4"]
    assert "gpus=2 precision=bf16" in worst


def test_at_most_15_worst_and_nothing_compared():
    rows = [row(i, err=float(i)) for i in range(20)]
    worst = report.markdown(rows, "cmd").split("worst plans", 1)[1].split("##", 1)[0]
    assert sum(line.startswith("| s0-") for line in worst.splitlines()) == 15
    assert "No plan was compared." in report.markdown(ROWS[5:], "cmd")
