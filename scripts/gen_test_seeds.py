"""Write tests/data/derived: the traced tables a whole default test run makes (`tests/seeds.py`), so that later runs
of the same package copy them instead of tracing the suite's small architectures again.

    python scripts/gen_test_seeds.py             # a whole default pytest run (two workers), then its tables
    python scripts/gen_test_seeds.py --from DIR  # the tables of a finished default run made on the package as it is
                                                 # now with LLMEM_CACHE_DIR=DIR and LLMEM_TEST_SEEDS=0
    python scripts/gen_test_seeds.py --check     # exit 1 unless the seeds match the package's sources

Run it after the last change to `llmem/` of a stop: any later change leaves the seeds unused (correct, slower)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.seeds import ROOT, current, write  # noqa: E402


def run_suite(cache_dir: Path) -> int:
    env = dict(os.environ, LLMEM_CACHE_DIR=str(cache_dir), LLMEM_TEST_SEEDS="0")
    workers = os.environ.get("LLMEM_TEST_WORKERS", "2")
    return subprocess.call([sys.executable, "-m", "pytest", "-n", workers, "-q", "-p", "no:cacheprovider"],
                           cwd=ROOT, env=env)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--from", dest="source", type=Path, help="a finished run's cache directory")
    p.add_argument("--check", action="store_true")
    args = p.parse_args()
    if args.check:
        ok = current()
        print("seeds current" if ok else "seeds stale: run scripts/gen_test_seeds.py")
        return 0 if ok else 1
    if args.source is not None:
        print(f"{write(args.source)} tables written")
        return 0
    with tempfile.TemporaryDirectory(prefix="llmem-seeds-") as tmp:
        code = run_suite(Path(tmp))
        if code != 0:
            print(f"the run failed (exit {code}): seeds not written")
            return code
        print(f"{write(Path(tmp))} tables written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
