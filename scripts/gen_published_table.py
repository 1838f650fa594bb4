"""Generate docs/PUBLISHED.md: the published GPU measurements the estimator claims to model, estimate vs measured
per row and per source, and why the other rows are not compared (`llmem/published.py`).

Run `python scripts/gen_published_table.py` after changing the estimator; `--check` exits 1 if the file is stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llmem.published import render_markdown  # noqa: E402

OUT = ROOT / "docs" / "PUBLISHED.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/PUBLISHED.md is stale")
    args = parser.parse_args(argv)
    text = render_markdown()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print("docs/PUBLISHED.md is stale: run python scripts/gen_published_table.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
