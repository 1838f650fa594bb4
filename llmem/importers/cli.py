"""`--from FILE` on the plan commands: the files fill the options the user did not give, the report is printed
before the result (or joins the JSON as "import"), and an option a file set that the plan refuses says which key set
it."""

from __future__ import annotations

import argparse

from llmem.errors import InputError
from llmem.importers.merge import import_files
from llmem.options import ARGUMENT, OPTIONS

HELP = ("a training config to read the plan from: DeepSpeed JSON, accelerate YAML, HF TrainingArguments / TRL "
        "SFTConfig (JSON/YAML), PEFT adapter_config.json, axolotl, LLaMA-Factory or torchtune YAML. Repeatable: later "
        "files override earlier ones, flags override files; prints what each key set, ignored or left at its default "
        "(docs/IMPORT.md). DeepSpeed ZeRO-0/1/2 set --engine deepspeed; ZeRO-3 maps to the nearest PyTorch program "
        "only with --engine torch (every stage does with it); "
        "FSDP1's set --engine fsdp1 (with --engine torch: the nearest FSDP2 plan)")
_UNSET = object()


def add_from_argument(p: argparse.ArgumentParser) -> None:
    """`--from FILE` (repeatable); `--model` may then come from a file."""
    p.add_argument("--from", dest="from_files", action="append", default=None, metavar="FILE", help=HELP)
    p.set_defaults(plan_parser=p)
    for action in p._actions:
        if action.dest == "model":
            action.required = False


def explicit_options(args: argparse.Namespace) -> dict:
    """The plan options the command line gave, whatever their value (a second parse that applies no defaults)."""
    names = [o.name for o in OPTIONS if o.cli == ARGUMENT]
    probe = argparse.Namespace(**dict.fromkeys(names, _UNSET))
    args.plan_parser.parse_args(getattr(args, "argv", []), namespace=probe)
    return {n: getattr(probe, n) for n in names if getattr(probe, n) is not _UNSET}


def apply(args: argparse.Namespace) -> None:
    """Fill `args` from its --from files (a no-op without them) and print the report unless --json."""
    if getattr(args, "from_files", None):
        explicit = explicit_options(args)
        engine_torch = str(explicit.get("engine", "")).strip().lower() == "torch"
        args.imported = import_files(args.from_files, engine_torch, explicit)
        _fill_from_model(args)
        for name, value in args.imported.options.items():
            setattr(args, name, value)
        if not args.json:
            print("\n".join(args.imported.lines()) + "\n")
    if getattr(args, "model", "") is None:  # argparse's own words without --from
        hint = " (or a --from file naming a preset's model)" if getattr(args, "from_files", None) else ""
        raise InputError("arguments", f"the following arguments are required: --model{hint}")


def _fill_from_model(args: argparse.Namespace) -> None:
    """The "auto"s the Trainer fills from the model (DeepSpeed's reduce_bucket_size), from --model or a file's."""
    result = args.imported
    model = result.options.get("model") or getattr(args, "model", None)
    if not result.model_autos or not model:
        return
    from llmem.cli import _spec_and_origin

    result.fill_from_model(_spec_and_origin(model)[0].hidden_size)


def blame(error: InputError, args: argparse.Namespace) -> InputError:
    """`error` with the file and key that set the option it names, when a file did."""
    result = getattr(args, "imported", None)
    line = next((x for x in result.used if x.option.replace("_", "-") == error.field), None) if result else None
    if line is None:
        return error
    message = str(error).split(": ", 1)[-1]
    return InputError(error.field, f"{message} ({error.field} set by {line.file}: {line.key})", error.kind)


def as_json(args: argparse.Namespace) -> dict:
    result = getattr(args, "imported", None)
    return {"import": result.to_dict()} if result is not None else {}
