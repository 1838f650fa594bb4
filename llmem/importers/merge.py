"""Several files into one `ImportResult`: later files override earlier ones, options the user gave explicitly
override every file, DeepSpeed "auto" values are filled from the other files as the HF Trainer fills them, and the
options nobody set are listed with their defaults."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from types import SimpleNamespace

from llmem.importers.core import ImportResult, Line, Reader
from llmem.importers.detect import detect
from llmem.importers.no_sync import resolve as resolve_no_sync
from llmem.importers.read import parse, read_path
from llmem.options import BY_NAME, PLAN_OPTIONS


def read_one(data: bytes, name: str, engine_torch: bool = False) -> tuple[Reader, str]:
    """One file's reader, filled by its format's module, and the format's name."""
    tree = parse(data, name)
    fmt = detect(tree, name)
    reader = Reader(name, tree, engine_torch)
    fmt.read(reader)
    return reader, fmt.NAME


def import_uploads(files: Iterable[tuple[bytes, str]], engine_torch: bool = False,
                   explicit: Mapping[str, object] | None = None) -> ImportResult:
    """Files as (bytes, file name), in order; `explicit`: options the user set, which no file overrides. The app
    calls this with its uploads; `engine_torch` maps DeepSpeed / FSDP1 settings to the nearest PyTorch program."""
    explicit = dict(explicit or {})
    result = ImportResult()
    autos: list[Line] = []
    no_sync = None  # the last Trainer file's (`importers.no_sync`)
    for data, name in files:
        reader, fmt = read_one(data, name, engine_torch)
        result.files.append((name, fmt))
        for line in reader.used:
            _use(result, line)
        result.ignored.extend(reader.ignored)
        autos.extend(reader.autos)
        no_sync = reader.no_sync or no_sync
    _explicit(result, explicit)
    resolve_no_sync(result, no_sync, explicit)
    auto_defaults = _autos(result, autos, explicit)
    result.defaults = _defaults(result, explicit, auto_defaults)
    return result


def import_bytes(data: bytes, filename: str, engine_torch: bool = False) -> ImportResult:
    """One uploaded file (the app's upload box): what it determines, what it leaves, and why."""
    return import_uploads([(data, filename)], engine_torch)


def import_files(paths: Iterable[str], engine_torch: bool = False,
                 explicit: Mapping[str, object] | None = None) -> ImportResult:
    """`--from` files in order (a later file overrides an earlier one)."""
    from pathlib import Path

    return import_uploads(((read_path(p), Path(p).name or p) for p in paths), engine_torch, explicit)


def _use(result: ImportResult, line: Line) -> None:
    earlier = result.source(line.option)
    if earlier is not None and _autocast_only(earlier, line):
        half = str(earlier.setting)
        result.ignored.append(Line(line.file, line.key, line.value, line.option, line.setting, f"autocast in {half}; "
                                   f"the weights stay {half} as {earlier.file}: {earlier.key} loads them"))
        return
    if earlier is not None:
        result.used.remove(earlier)
        result.ignored.append(Line(earlier.file, earlier.key, earlier.value, earlier.option, earlier.setting,
                                   f"overridden by {line.file}: {line.key}"))
    result.used.append(line)
    result.options[line.option] = line.setting


def _autocast_only(earlier: Line, later: Line) -> bool:
    """A launcher's mixed precision (accelerate's bf16) over a file that loads the weights in that dtype (axolotl,
    torchtune, LLaMA-Factory's LoRA base): the weights stay half; autocast adds nothing llmem models apart."""
    return earlier.option == "precision" and str(later.setting) == f"{earlier.setting}-mixed"


def _explicit(result: ImportResult, explicit: Mapping[str, object]) -> None:
    for line in [x for x in result.used if x.option in explicit]:
        result.used.remove(line)
        result.options.pop(line.option, None)
        result.ignored.append(Line(line.file, line.key, line.value, line.option, line.setting,
                                   f"overridden by --{BY_NAME[line.option].key} on the command line"))
    for i, line in enumerate(result.ignored):  # another engine's key, whose option the command line gives anyway
        if line.option in explicit and not line.why.startswith("overridden"):
            result.ignored[i] = replace(line, why=f"{line.why}; --{BY_NAME[line.option].key} on the command line "
                                        "sets it")


def _autos(result: ImportResult, autos: list[Line], explicit: Mapping[str, object]) -> dict[str, str]:
    """Each "auto" filled from the file that sets its option (or the command line); the others' reasons."""
    unresolved: dict[str, str] = {}
    for auto in autos:
        source = result.source(auto.option)
        if auto.option in explicit:
            result.ignored.append(Line(auto.file, auto.key, auto.value, why=f"'auto': filled by "
                                       f"--{BY_NAME[auto.option].key} on the command line"))
        elif auto.why.startswith("model's"):  # filled once the model is known (`ImportResult.fill_from_model`)
            result.model_autos.append(auto)
            unresolved[auto.option] = (f"{auto.file}: {auto.key} is {auto.value}, which the HF Trainer fills from the "
                                       f"{auto.why}; no model is known yet")
        elif source is not None:
            why = f"filled from {source.file}: {source.key}, as the HF Trainer and accelerate fill it"
            result.used.append(Line(auto.file, auto.key, auto.value, auto.option, source.setting, why))
        else:
            unresolved[auto.option] = (f"{auto.file}: {auto.key} is {auto.value}, which the HF Trainer fills from "
                                       f"its {auto.why}; no file gives it")
    return unresolved


def _defaults(result: ImportResult, explicit: Mapping[str, object], why: dict[str, str]) -> list[Line]:
    """The plan's options no file and no flag set, with their defaults (those that mean something in this plan)."""
    final = {o.name: o.default for o in PLAN_OPTIONS} | result.options | dict(explicit)
    values = SimpleNamespace(**{k: str(v) for k, v in final.items()})
    out = []
    for option in PLAN_OPTIONS:
        if option.name in result.options or option.name in explicit:
            continue
        if option.needs is not None and not option.needs.met(values):
            continue
        out.append(Line("", "", "", option.name, option.default, why.get(option.name, "no file sets it")))
    return out
