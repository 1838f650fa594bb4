"""A training config's bytes as a tree: JSON or YAML (PyYAML's safe loader only), bounded in size, never a pickle.

Nothing in a file is executed, imported or followed: YAML tags that construct objects are refused by the safe loader,
and a path a file names is never opened.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from llmem.errors import InputError
from llmem.sources import MAX_CONFIG_DEPTH, _nesting_depth

MAX_BYTES = 256 * 1024
MAX_NODES = 10_000  # YAML values and keys: a training config has a few hundred; building 100k takes seconds
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".safetensors", ".npy", ".npz")
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def refuse_binary(data: bytes, name: str) -> None:
    """A pickle (`training_args.bin` is `torch.save(TrainingArguments)`) or any binary file: one line, never opened."""
    lower = name.lower()
    pickled = data[:1] == b"\x80" or data[:4] == b"PK\x03\x04"
    if lower.endswith(PICKLE_SUFFIXES) or pickled:
        hint = ("save the arguments as JSON instead (trainer.args.to_json_string()) or pass the YAML/JSON you "
                "trained with" if "training_args" in lower or pickled else "pass a JSON or YAML config")
        raise InputError(f"--from {name}", f"is a binary or pickled file; llmem never unpickles files: {hint}")


def parse(data: bytes, name: str) -> dict:
    """The mapping at the top of `data` (JSON if the name ends in .json or the text starts with '{', else YAML)."""
    field = f"--from {name}"
    if len(data) > MAX_BYTES:
        raise InputError(field, f"is {len(data):,} bytes; a training config is a few kilobytes "
                         f"(limit {MAX_BYTES // 1024} KiB)")
    refuse_binary(data, name)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise InputError(field, f"is not UTF-8 text (byte {e.start}); expected a JSON or YAML config") from None
    if "\x00" in text:
        raise InputError(field, "contains NUL bytes; expected a JSON or YAML config")
    if _nesting_depth(text) > MAX_CONFIG_DEPTH:
        raise InputError(field, f"nests more than {MAX_CONFIG_DEPTH} levels deep; a training config nests a few")
    as_json = name.lower().endswith(".json") or text.lstrip().startswith("{")
    try:
        tree = json.loads(text) if as_json else _yaml(text, field)
    except json.JSONDecodeError as e:
        raise InputError(field, f"is not valid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except yaml.MarkedYAMLError as e:
        where = f" at line {e.problem_mark.line + 1}" if e.problem_mark else ""
        raise InputError(field, f"is not valid YAML{where}: {e.problem or e.context}") from None
    except Exception as e:  # noqa: BLE001 - the parsers' other failures on hostile text (digit limits, recursion)
        raise InputError(field, f"cannot be read as {'JSON' if as_json else 'YAML'} "
                         f"({(str(e).splitlines() or [type(e).__name__])[0][:120]})") from None
    if not isinstance(tree, dict):
        raise InputError(field, f"expected a mapping of keys at the top, got {type(tree).__name__}")
    return tree


def _yaml(text: str, field: str) -> object:
    """PyYAML's safe loader, after counting the parser's events (libyaml's C parser: fast) so that a file of a
    hundred thousand tiny values is refused before Python builds them."""
    for count, _ in enumerate(yaml.parse(text, Loader=_LOADER)):
        if count > MAX_NODES:
            raise InputError(field, f"holds more than {MAX_NODES:,} YAML values; a training config holds a few "
                             "hundred")
    return yaml.load(text, Loader=_LOADER)  # noqa: S506 (a safe loader)


def read_path(path: str) -> bytes:
    """The bytes of the file the user named (never a path a file names), at most `MAX_BYTES` + 1 of them."""
    field = f"--from {Path(path).name or path}"
    p = Path(path)
    try:
        if p.is_dir():
            raise InputError(field, f"{path} is a directory; give a config file")
        with p.open("rb") as f:
            return f.read(MAX_BYTES + 1)
    except OSError as e:
        raise InputError(field, f"cannot read {path}: {e.strerror or type(e).__name__}") from None
