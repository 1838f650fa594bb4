"""The `sweep` verb: `python -m llmem sweep --random N --seed S [--oracle measure|simulate] [--size small|derived|full]
[--out F.jsonl] [--markdown docs/SWEEP.md] [--resume] [--report]`. `llmem/cli.py` calls `register()`."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from llmem.errors import InputError
from llmem.sweep.models import SIZES

ORACLES = ("measure", "simulate")
MAX_RANDOM = 1_000_000


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "sweep", help="estimate vs an oracle (measured on CPU, or simulated) over randomly drawn plans",
        description="Draw random plans over every option the estimator accepts, estimate each, run the oracle on "
        "the accepted ones, append one JSON line per plan to --out as it finishes, and write the error "
        "distribution, the worst cases and the refusals to --markdown.")
    p.add_argument("--random", default=None, metavar="N", help="how many plans to draw (plans 0..N-1 of the seed)")
    p.add_argument("--seed", default="0", metavar="S", help="the draw's seed (default 0)")
    p.add_argument("--oracle", default="measure", metavar="|".join(ORACLES),
                   help="measure: the real step on CPU (cpu profile); simulate: fake tensors (cuda profile)")
    p.add_argument("--size", default="small", metavar="|".join(SIZES),
                   help="small: tiny configs (1-4 ranks); derived: tiny configs of the architectures traced from "
                   "transformers (1-4 ranks); full: the families' default configs (simulate only)")
    p.add_argument("--out", default="out/sweep.jsonl", help="JSONL of the rows (default out/sweep.jsonl)")
    p.add_argument("--markdown", default=None, help="also write the report page to this markdown file")
    p.add_argument("--block", default="8", help="plans estimated and measured per batch (default 8)")
    p.add_argument("--resume", action="store_true",
                   help="keep the rows already in --out and draw only the rest (and the plans refused then that the "
                   "estimator accepts now)")
    p.add_argument("--report", action="store_true", help="run nothing: render --markdown from the rows in --out")
    p.add_argument("--reestimate", action="store_true",
                   help="with --report: estimate every compared plan again with this estimator against its recorded "
                   "oracle figure (checks a formula change on an earlier sweep without running the oracle)")
    p.set_defaults(func=cmd_sweep)


def _count(field: str, value, minimum: int, maximum: int) -> int:
    text = str(value).strip()
    if not text.lstrip("-").isdigit() or not minimum <= int(text) <= maximum:
        raise InputError(field, f"must be a whole number from {minimum} to {maximum:,}, got {value!r}")
    return int(text)


def check_args(args) -> dict:
    """The sweep's arguments, checked: InputError naming the field otherwise."""
    oracle, size = str(args.oracle).strip().lower(), str(args.size).strip().lower()
    if oracle not in ORACLES:
        raise InputError("oracle", f"{args.oracle!r} is not one of: {', '.join(ORACLES)}")
    if size not in SIZES:
        raise InputError("size", f"{args.size!r} is not one of: {', '.join(SIZES)}")
    if oracle == "measure" and size == "full":
        raise InputError("size", "the measure oracle runs on CPU with tiny models; full-size models need "
                         "--oracle simulate")
    if args.random is None and not args.report:
        raise InputError("random", "give the number of plans to draw, e.g. --random 50 (or --report)")
    n = 0 if args.random is None else _count("random", args.random, 1, MAX_RANDOM)
    seed = _count("seed", args.seed, 0, 2**63 - 1)
    block = _count("block", args.block, 1, 1000)
    out = Path(args.out)
    if out.is_dir():
        raise InputError("out", f"{out} is a directory; give a .jsonl file")
    if args.report and not out.is_file():
        raise InputError("out", f"{out} does not exist; --report renders the rows of an earlier sweep")
    if getattr(args, "reestimate", False) and not args.report:
        raise InputError("reestimate", "--reestimate re-renders an earlier sweep: give --report and --out too")
    if args.report and not args.markdown:
        raise InputError("markdown", "--report writes the page: give --markdown FILE")
    return {"n": n, "seed": seed, "oracle": oracle, "size": size, "out": out, "block": block}


def cmd_sweep(args) -> int:
    from llmem.sweep.report import markdown
    from llmem.sweep.run import read_rows, reestimate, sweep

    a = check_args(args)
    if args.report:
        rows = read_rows(a["out"])
        rows = reestimate(rows) if getattr(args, "reestimate", False) else rows
    else:
        rows = sweep(a["n"], a["seed"], a["oracle"], a["size"], a["out"], resume=args.resume, block=a["block"],
                     log=lambda line: print(line, file=sys.stderr, flush=True))
    command = "python -m llmem sweep " + " ".join(shlex.quote(x) for x in getattr(args, "argv", []))
    page = markdown(rows, command.strip())
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(page)
    # On the terminal: the outcomes and the error distribution (the page has the rest).
    print("## Outcomes" + page.split("## Outcomes", 1)[1].split("\n## Per option", 1)[0].rstrip())
    return 0
