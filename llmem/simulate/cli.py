"""The `simulate` subcommand: `python -m llmem simulate <estimate's options> [--rank R] [--steps 2] [--json]
[--timeline FILE]`. `llmem/cli.py` calls `register()`."""

from __future__ import annotations

import csv
import json
import sys

from llmem.errors import InputError


def register(subparsers, add_plan_arguments, plan_from_args) -> None:
    p = subparsers.add_parser(
        "simulate", help="run the plan on fake tensors: per-op timeline, peak, caching-allocator reserve",
        description="Build the model from its config under FakeTensorMode (no memory), wrap it for the scheme "
        "(multi-rank schemes on torch's fake process group, as one rank), run the iterations of DESIGN.md §1 and "
        "record every allocation and free; replay them through a model of the CUDA caching allocator.")
    add_plan_arguments(p)
    p.add_argument("--rank", type=int, default=None,
                   help="rank to simulate (default: the one with the largest memory; rank 0 except ZeRO-1; "
                   "--pp (rank = stage) and --engine deepspeed: default every rank, the worst reported)")
    p.add_argument("--steps", type=int, default=2, help="training iterations (default 2)")
    p.add_argument("--timeline", default=None, metavar="FILE",
                   help="write every point of the timeline (op_index, live_bytes, phase) to this CSV file")
    p.add_argument("--top", type=int, default=20, help="largest live tensors at the peak to print (default 20)")
    p.set_defaults(func=lambda args: cmd_simulate(args, plan_from_args))


def _config(model: str) -> dict:
    from llmem.sources import resolve_model

    return resolve_model(model).config


def write_timeline(sim, path: str) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["op_index", "live_bytes", "phase"])
        w.writerows(sim.timeline)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def render(sim, top: int = 20) -> str:
    plan = sim.plan
    lines = [f"{plan.strategy_label}, rank {sim.rank} of {plan.gpus}, micro-batch {plan.batch_size} × {plan.seq_len}, "
             f"{plan.precision}, {plan.optimizer} ({plan.effective_optimizer_impl}), profile {plan.device}",
             f"peak {sim.peak_bytes:,} B ({_mib(sim.peak_bytes)}) in {sim.peak_phase} of iteration "
             f"{sim.peak_iteration}, op {sim.peak_op_index}; at the reset {_mib(sim.live_at_reset)}",
             f"caching allocator: max allocated {_mib(sim.allocated_rounded_bytes)} (512-B blocks), max reserved "
             f"{_mib(sim.reserved_bytes)} (fragmentation {_mib(sim.fragmentation_bytes)}; at the peak "
             f"{_mib(sim.fragmentation_at_peak_bytes)}); with expandable_segments "
             f"{_mib(sim.reserved_expandable_bytes)}",
             "", f"{'phase':<12}{'iter':>5}{'start':>16}{'peak':>16}{'end':>16}"]
    for ph in sim.phases:
        lines.append(f"{ph.name:<12}{ph.iteration:>5}{_mib(ph.start_bytes):>16}{_mib(ph.peak_bytes):>16}"
                     f"{_mib(ph.end_bytes):>16}")
    lines += ["", f"largest live tensors at the peak ({min(top, len(sim.top_tensors))}):",
              f"{'bytes':>16}  {'shape':<26}{'op':<28}{'phase':<14}module"]
    for t in sim.top_tensors[:top]:
        lines.append(f"{t.nbytes:>16,}  {t.shape[:25]:<26}{t.op[:27]:<28}{f'{t.phase} {t.iteration}':<14}"
                     f"{t.module or '-'}")
    if sim.host_bytes:
        lines.append(f"host memory (offloaded, not in the peak): {sim.host_bytes:,} B ({_mib(sim.host_bytes)}) at most")
    if sim.rank_peaks:
        lines.append(f"per {'stage (rank = stage)' if sim.stage_peaks else 'rank'}: "
                     + ", ".join(f"{i}: {_mib(b)}" for i, b in enumerate(sim.rank_peaks)))
    for c in sim.closed_form:
        lines.append(f"closed form: {c}")
    for n in sim.notes:
        lines.append(f"note: {n}")
    lines.append(f"{sim.ops:,} ops, {sim.events:,} allocation events, {sim.seconds:.1f} s")
    return "\n".join(lines)


def cmd_simulate(args, plan_from_args) -> int:
    from llmem.simulate import simulate

    try:
        plan = plan_from_args(args)
        sim = simulate(_config(args.model), plan, rank=args.rank, steps=args.steps)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"error: simulate: {str(exc).strip().splitlines()[0] if str(exc).strip() else exc}", file=sys.stderr)
        return 1
    if args.timeline:
        write_timeline(sim, args.timeline)
    if getattr(args, "json", False):
        print(json.dumps(sim.to_dict()))
    else:
        print(render(sim, args.top))
        if args.timeline:
            print(f"timeline ({len(sim.timeline):,} points) written to {args.timeline}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m llmem.simulate ...`: the same subcommand as `python -m llmem simulate`."""
    import argparse

    from llmem.cli import add_plan_arguments, plan_from_args

    parser = argparse.ArgumentParser(prog="python -m llmem.simulate")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub, add_plan_arguments, plan_from_args)
    args = parser.parse_args(["simulate", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)
