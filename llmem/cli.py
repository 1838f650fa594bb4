"""Command line (DESIGN.md section 3): `estimate`, `compare`, `plan-ckpt`, `measure`, `validate`, `simulate`,
`sweep`.

Builds a TrainingPlan from the options, calls the library, renders. Errors: one line on stderr naming the field,
exit code 2, no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

from llmem.errors import InputError
from llmem.help import EAGER_ONLY, HELP
from llmem.importers import cli as importing
from llmem.options import ARGUMENT, BY_NAME, OPTIONS, PLAN_OPTIONS
from llmem.plan import TrainingPlan
from llmem.units import format_gib, format_params


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own errors: same one-line form, exit 2
        raise InputError("arguments", message)


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """Every option of `llmem.options` that each plan command takes (`--model`, the plan's fields, `--engine`)."""
    for option in OPTIONS:
        if option.cli == ARGUMENT:
            p.add_argument(f"--{option.key}", **option.cli_argument())
    p.add_argument("--json", action="store_true", help="print one JSON object")


def plan_from_args(args: argparse.Namespace) -> TrainingPlan:
    importing.apply(args)  # --from files: fill what the flags left, print what each key set
    try:
        return TrainingPlan(**{option.name: getattr(args, option.name) for option in PLAN_OPTIONS})
    except InputError as e:
        raise importing.blame(e, args) from None


def _spec_and_origin(model: str):
    from llmem.sources import resolve_model
    from llmem.spec import modelled_spec

    source = resolve_model(model)
    config = {"_name_or_path": model, **source.config}
    return modelled_spec(config), source.origin


def cmd_estimate(args: argparse.Namespace) -> int:
    from llmem.estimate import RISK_FIX, estimate

    plan = plan_from_args(args)
    spec, origin = _spec_and_origin(args.model)
    est = estimate(spec, plan)
    gpu = _gpu(args)
    if args.json:
        out = est.to_dict() | {"origin": origin, "caveats": list(spec.caveats)} | importing.as_json(args)
        if gpu is not None:
            out |= {"gpu_type": gpu.key, "gpu_memory_bytes": gpu.memory_bytes,
                    "fits": est.device_total_bytes <= gpu.memory_bytes, "verdict": est.verdict(gpu.memory_bytes)}
        print(json.dumps(out, indent=2))
        return 0
    print(f"{spec.name} ({spec.model_type}, {format_params(spec.total_params)} parameters) — from {origin}")
    batch = f"micro-batch {plan.batch_size}" if plan.pp == 1 else \
        f"step batch {plan.batch_size} in {plan.microbatches} microbatches ({plan.pp_schedule})"
    print(f"{plan.strategy_label} on {plan.gpus} GPU(s), {batch} × {plan.seq_len} tokens, "
          f"{plan.precision}, {plan.optimizer} ({plan.effective_optimizer_impl}), profile {plan.device}")
    print(f"\nper-GPU peak (max_memory_allocated): {format_gib(est.peak_bytes)} at '{est.peak_phase}'")
    if est.stage_peaks:
        runs = "GPU i runs stages i, i + pp, ..." if str(plan.pp_schedule) == "interleaved-1f1b" else \
            "GPU i runs stage i"
        if plan.dp > 1:  # torchtitan's mesh: pp outer, the stage's data-parallel replicas neighbours
            runs = f"stage i on GPUs {plan.dp}·i .. {plan.dp}·i + {plan.dp - 1}"
        print(f"per pipeline GPU ({runs}): "
              + ", ".join(f"{i}: {format_gib(b)}" for i, b in enumerate(est.stage_peaks)))
    width = max(len(str(c)) for c in est.breakdown)
    for cat, b in est.breakdown.items():
        if b:
            print(f"  {str(cat):<{width}}  {format_gib(b):>12}")
    print("outside the allocator's count:")
    print(f"  {'fragmentation allowance':<{width}}  {format_gib(est.fragmentation_bytes):>12}")
    print(f"  {'CUDA context':<{width}}  {format_gib(est.cuda_context_bytes):>12}")
    if est.paged_state_bytes:
        print(f"  {'paged optimizer states':<{width}}  {format_gib(est.paged_state_bytes):>12}")
    low, high = est.device_total_bytes_range
    print(f"device total (as nvidia-smi shows): {format_gib(est.device_total_bytes)}"
          + (f" (up to {format_gib(high)}: {RISK_FIX})" if high > low else ""))
    if est.host_bytes:
        print(f"host memory (offloaded, not in the GPU figures): {format_gib(est.host_bytes)} per rank "
              f"({format_gib(est.host_pinned_bytes)} of it pinned, power-of-two blocks), "
              f"{format_gib(est.host_node_bytes)} per node of {est.to_dict()['host_ranks_per_node']} ranks")
        for cat, b in est.host_breakdown.items():
            print(f"  {str(cat):<{width}}  {format_gib(b):>12}")
    for caveat in (*spec.caveats, *est.notes):
        print(f"note: {caveat}")
    if gpu is not None:
        print(f"verdict: {_verdict(est, gpu)}")
    return 0


def _verdict(est, gpu) -> str:
    """The verdict on the high end of the device total (`Estimate.verdict`), in words."""
    from llmem.estimate import FITS, RISKY

    verdict = est.verdict(gpu.memory_bytes)
    if verdict == FITS:
        return f"fits on {gpu.name} with {format_gib(gpu.memory_bytes - est.device_total_bytes_range[1])} to spare"
    if verdict == RISKY:
        return (f"fits on {gpu.name} only at the low end (risky): {format_gib(est.device_total_bytes)} of "
                f"{format_gib(gpu.memory_bytes)}, up to {format_gib(est.device_total_bytes_range[1])}")
    return f"does NOT fit on {gpu.name}: short by {format_gib(est.device_total_bytes - gpu.memory_bytes)}"


def _gpu(args):
    if getattr(args, "gpu_type", None) is None:  # only estimate's --gpu-type is optional; '' is an error
        return None
    from llmem.gpus import get_gpu

    return get_gpu(args.gpu_type)


def cmd_compare(args: argparse.Namespace) -> int:
    from llmem.compare import compare, method_variants

    if str(args.engine) == "deepspeed" and int(args.zero) == 3 and int(args.gpus) > 1:  # ZeRO-0/1/2 modelled
        args.zero = 2
    plan = plan_from_args(args)
    spec, origin = _spec_and_origin(args.model)
    gpu = _gpu(args)
    result = compare(spec, plan, gpu.memory_bytes, variants=method_variants(args.methods))
    frame = result.to_frame()
    if args.csv:
        _write_csv(frame, args.csv)
    if args.json:
        print(json.dumps({"origin": origin, "gpu_type": gpu.key, "rows": frame.to_dict("records"),
                          "recommended": result.recommended.label if result.recommended else None,
                          "reason": result.reason} | importing.as_json(args), indent=2))
        return 0
    print(f"{spec.name} on {plan.gpus} × {gpu.name} ({format_gib(gpu.memory_bytes)} each), micro-batch "
          f"{plan.batch_size} × {plan.seq_len}, {plan.precision} — GiB per GPU")
    cols = ["strategy", "peak_gib", "device_total_gib", "device_total_high_gib", "verdict", "headroom_gib",
            "max_batch_size", "peak_phase"]
    if frame["host_node_gib"].any():  # some row offloads: its host RAM per node stands beside the GPU figures
        cols.append("host_node_gib")
    print(frame[cols + ["recommended"]].to_string(index=False))
    print(f"\nrecommended: {result.reason}")
    from llmem.notes import table_notes

    for note in table_notes(spec, [r.plan for r in result.rows]):
        print(f"note: {note}")
    if args.csv:
        print(f"table written to {args.csv}")
    return 0


def _write_csv(frame, path: str) -> None:
    """`--csv PATH`: a file to create or overwrite; a directory, a missing folder or a failed write is one line."""
    from pathlib import Path

    try:
        if Path(path).is_dir():
            raise InputError("csv", f"{path} is a directory; give a file name, e.g. {Path(path) / 'compare.csv'}")
        frame.to_csv(path, index=False)
    except OSError as e:
        raise InputError("csv", f"cannot write {path}: {e.strerror or str(e).splitlines()[0]}") from None


def cmd_plan_ckpt(args: argparse.Namespace) -> int:
    from llmem.checkpointing import plan_checkpointing

    plan = plan_from_args(args)
    spec, origin = _spec_and_origin(args.model)
    gpu = _gpu(args)
    result = plan_checkpointing(spec, plan, gpu.memory_bytes)
    if args.json:
        print(json.dumps({"origin": origin, "gpu_type": gpu.key, "gpu_memory_bytes": gpu.memory_bytes}
                         | result.to_dict() | importing.as_json(args), indent=2))
        return 0
    print(f"{spec.name}: {plan.strategy_label} on {plan.gpus} × {gpu.name} ({format_gib(gpu.memory_bytes)} each), "
          f"micro-batch {plan.batch_size} × {plan.seq_len}, {plan.precision}")
    print(f"{'checkpointing':<18} {'recomputed':>10} {'device total':>13} {'fits':>5}  {'extra fwd FLOPs':>15}")
    for o in result.options:
        mark = "  <- chosen" if o is result.chosen else ""
        print(f"{o.label:<18} {o.recomputed_layers:>10} {format_gib(o.estimate.device_total_bytes):>13} "
              f"{'yes' if o.fits else 'no':>5}  {o.extra_forward_flops:>15.3g}{mark}")
    print(f"\n{result.reason}")
    return 0 if result.chosen is not None else 1


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m llmem", description="Per-GPU memory of LLM fine-tuning, by strategy.",
                     epilog=EAGER_ONLY)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    est = sub.add_parser("estimate", help="per-GPU peak memory of one plan", epilog=EAGER_ONLY)
    add_plan_arguments(est)
    importing.add_from_argument(est)
    est.add_argument("--gpu-type", **BY_NAME["gpu_type"].cli_argument(default=None))
    est.set_defaults(func=cmd_estimate)
    cmp_ = sub.add_parser("compare", help="every strategy for a GPU count and type", epilog=EAGER_ONLY)
    add_plan_arguments(cmp_)
    importing.add_from_argument(cmp_)
    cmp_.add_argument("--gpu-type", **BY_NAME["gpu_type"].cli_argument(default="h100-80gb"))
    cmp_.add_argument("--csv", default=None, help="write the comparison table to this CSV file")
    cmp_.add_argument("--methods", **BY_NAME["methods"].cli_argument(default=""))
    cmp_.set_defaults(func=cmd_compare)
    pck = sub.add_parser("plan-ckpt", help=HELP["plan-ckpt"], description=HELP["plan-ckpt"], epilog=EAGER_ONLY)
    add_plan_arguments(pck)
    importing.add_from_argument(pck)
    pck.add_argument("--gpu-type", **BY_NAME["gpu_type"].cli_argument(default="h100-80gb"))
    pck.set_defaults(func=cmd_plan_ckpt)
    try:
        from llmem.measure.cli import register
    except ImportError:  # measurement needs torch; the estimator does not
        register = None
    if register is not None:
        register(sub, add_plan_arguments, plan_from_args)
    from llmem.simulate.cli import register as register_simulate

    register_simulate(sub, add_plan_arguments, plan_from_args)
    from llmem.sweep.cli import register as register_sweep

    register_sweep(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        args.argv = list(sys.argv[2:] if argv is None else argv[1:])
        return args.func(args)
    except InputError as e:
        print(f"llmem: error: {e}", file=sys.stderr)
        return 2
