"""The `measure` and `validate` subcommands (docs/DESIGN.md §3). `llmem/cli.py` calls `register()`."""

from __future__ import annotations

import argparse
import json
import sys

from llmem.errors import InputError


def register(subparsers, add_plan_arguments, plan_from_args) -> None:
    p = subparsers.add_parser("measure", help="run the plan for real and report each rank's peak",
                              description="Build the model, wrap it for the scheme, reset the peak, run the "
                              "iterations and report every rank's peak of allocated tensor bytes. Multi-rank plans "
                              "are launched with torchrun from here (or run inside an existing torchrun launch).")
    add_plan_arguments(p)
    p.add_argument("--steps", type=int, default=2, help="training iterations to run (default 2)")
    p.set_defaults(func=lambda args: cmd_measure(args, plan_from_args))

    v = subparsers.add_parser("validate", help="estimate vs measure over a grid of configurations",
                              description="Run every row of a suite (YAML or JSON), estimate and measure, and "
                              "write a CSV and markdown table with the signed error per row and the mean absolute "
                              "error per scheme.")
    v.add_argument("--suite", required=True, help="suite file (YAML or JSON)")
    v.add_argument("--device", default="cuda", choices=["cpu", "cuda"], help="device to measure on")
    v.add_argument("--out", default="out/validate", help="directory for validate.csv, validate.md, measured.jsonl")
    v.add_argument("--accuracy-md", default=None, help="also write this ACCURACY.md")
    v.add_argument("--resume", action="store_true", help="keep rows an earlier interrupted run already measured")
    v.set_defaults(func=cmd_validate)


def _model_config(model: str) -> dict:
    try:
        from llmem.sources import resolve_model
    except ImportError:
        resolve_model = None
    if resolve_model is not None:
        return resolve_model(model).config
    try:
        with open(model) as fh:
            return json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError("model", f"cannot read {model}: {exc}") from None


def measure(config: dict, plan, steps: int = 2) -> dict:
    """Measure a plan (launching torchrun when it needs several ranks) and return the JSON-ready result."""
    from llmem.measure.launch import run_job
    from llmem.measure.preflight import host_memory_problem
    from llmem.measure.validate import check_device
    from llmem.runtime.parallel import check_supported

    if steps < 1:
        raise InputError("steps", f"must be at least 1, got {steps}")
    check_supported(str(config.get("model_type")), plan, config)
    check_device(plan.device.value)
    problem = host_memory_problem(config, plan)
    if problem:
        raise InputError("model", problem)
    plan_dict = {k: v for k, v in plan.to_dict().items() if k != "device"}
    row = {"id": "measure", "config": config, "plan": plan_dict, "steps": steps}
    results, err = run_job([row], plan.gpus, plan.device.value)
    if not results:
        raise RuntimeError(err or "the run produced no result")
    res = results[0]
    res.pop("id", None)
    res["plan"] = plan.to_dict()
    res["steps"] = steps
    return res


def cmd_measure(args, plan_from_args) -> int:
    import os

    try:
        plan = plan_from_args(args)
        res = measure(_model_config(args.model), plan, args.steps)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"error: measure: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the launch and its files are already cleaned up (launch.py)
        print("error: measure: interrupted", file=sys.stderr)
        return 130
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # inside an existing torchrun launch, rank 0 reports for everyone
    if "error" in res:
        print(f"error: {res['error']}", file=sys.stderr)
        return 1
    if getattr(args, "json", False):
        print(json.dumps(res))
    else:
        ranks = ", ".join(f"{b / 2**20:.2f}" for b in res["per_rank"])
        print(f"peak {res['peak_bytes'] / 2**20:.2f} MiB per {res['device']} rank (max over ranks)")
        print(f"per rank (MiB): {ranks}")
        if "reserved_bytes" in res:
            print("reserved (MiB): " + ", ".join(f"{b / 2**20:.2f}" for b in res["reserved_bytes"]))
        print(f"torch {res['torch']}, transformers {res['transformers']}")
    return 0


def cmd_validate(args) -> int:
    from llmem.measure.validate import validate

    try:
        records = validate(args.suite, args.device, args.out, args.accuracy_md, resume=args.resume,
                           log=lambda msg: print(msg, file=sys.stderr))
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: validate: interrupted; rows measured so far are in measured.jsonl (--resume keeps them)",
              file=sys.stderr)
        return 130
    failed = sum(r["status"] == "failed" for r in records)
    over = sum(r["status"] == "over tolerance" for r in records)
    print(f"{len(records)} rows: {failed} failed, {over} over tolerance; wrote {args.out}/validate.csv and "
          f"{args.out}/validate.md" + (f" and {args.accuracy_md}" if args.accuracy_md else ""))
    return 1 if failed or over else 0


def main(argv: list[str] | None = None) -> int:
    """`python -m llmem.measure measure|validate ...`: the same subcommands as `python -m llmem`."""
    from llmem.cli import add_plan_arguments, plan_from_args

    parser = argparse.ArgumentParser(prog="python -m llmem.measure")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub, add_plan_arguments, plan_from_args)
    args = parser.parse_args(argv)
    return args.func(args)
