"""Where a model's config comes from: a preset, a local `config.json`, or the Hugging Face hub.

`resolve_model` tries, in order: a preset name (or the Hugging Face id of a preset, which then needs no
network); an existing path (a `config.json` file or a directory holding one); a Hugging Face id `org/name`
(optionally `org/name@revision`), loaded with transformers' own `AutoConfig.from_pretrained`. Every failure is
an `InputError("model", ...)` with a one-line message saying what to do. transformers is imported only for
the hub, inside the function, so the rest stays pure.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from llmem import presets
from llmem.errors import InputError

MAX_CONFIG_BYTES = 256 * 1024  # a config.json is a few kilobytes; anything bigger is not one
MAX_CONFIG_DEPTH = 32  # real configs nest 2-3 levels (text_config, rope_scaling); deeper is not a config
MAX_MODEL_CHARS = 1024  # longer than any path or hub id the OS and the hub accept
_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(@[\w./-]+)?$")


@dataclass(frozen=True)
class ModelSource:
    """A model config (the `config.json` dict) and a human-readable note of where it came from."""

    config: dict
    origin: str


def resolve_model(model: str) -> ModelSource:
    """Find the config for `model`: preset name, then local path, then Hugging Face id."""
    text = (model or "").strip()
    if not text:
        raise InputError("model", "empty; give a preset name (e.g. llama-3.1-8b), a config.json path or org/name")
    info = presets.find_preset(text)
    if info is not None:
        return ModelSource(presets.load_preset(info.name), f"preset {info.name} ({info.hf_id})")
    if len(text) > MAX_MODEL_CHARS:
        raise InputError("model", f"{len(text):,} characters long; a preset name, path or org/name is at most "
                         f"{MAX_MODEL_CHARS:,}")
    path = Path(text).expanduser()
    try:
        exists = path.exists()
    except (OSError, ValueError) as e:  # a name the OS refuses (too long, NUL byte)
        raise InputError("model", f"not a usable path: {getattr(e, 'strerror', None) or e}") from None
    if exists:
        return _from_path(path)
    if _HF_ID.match(text) and not text.endswith(".json"):
        repo_id, _, revision = text.partition("@")
        return load_from_hub(repo_id, revision or None)
    if _looks_like_path(text):
        raise InputError("model", f"no such file or directory: {text}")
    raise InputError("model", presets._unknown_message(text))


def _looks_like_path(text: str) -> bool:
    return text.endswith(".json") or text.startswith((".", "/", "~")) or "\\" in text or text.count("/") > 1


def _from_path(path: Path) -> ModelSource:
    """Read a `config.json` file, or the one inside a directory."""
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise InputError("model", f"{path} is a directory without a config.json")
    size = file.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise InputError("model", _too_big(file.name, size))
    try:
        data = file.read_bytes()
    except OSError as e:
        raise InputError("model", f"cannot read {file}: {e.strerror or e}") from None
    return ModelSource(config_from_bytes(data, str(file)), f"file {file.resolve()}")


def _too_big(name: str, size: int) -> str:
    return f"{name} is {size:,} bytes; a config.json is a few kilobytes (limit {MAX_CONFIG_BYTES // 1024} KiB)"


def config_from_bytes(data: bytes, name: str) -> dict:
    """Parse an uploaded or read `config.json`: bounded size, valid UTF-8 JSON, an object with `model_type`."""
    if len(data) > MAX_CONFIG_BYTES:
        raise InputError("model", _too_big(name, len(data)))
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise InputError("model", f"{name}: not UTF-8 text (byte {e.start}); is this really a config.json?") from None
    config = parse_json(text, name)
    if not isinstance(config, dict):
        raise InputError("model", f"{name}: expected a JSON object {{...}}, got {type(config).__name__}")
    if not isinstance(config.get("model_type"), str) or not config["model_type"]:
        raise InputError("model", f"{name}: no \"model_type\" key; is this a Hugging Face model config.json?")
    return config


def parse_json(text: str, name: str, field: str = "model"):
    """`json.loads` with its failures as one line: syntax, integers beyond Python's digit limit, nesting deeper
    than `MAX_CONFIG_DEPTH` (checked on the text first, so the parser never recurses deeply)."""
    if _nesting_depth(text) > MAX_CONFIG_DEPTH:
        raise InputError(field, f"{name}: JSON nested more than {MAX_CONFIG_DEPTH} levels deep; a config.json "
                         "nests two or three")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(field, f"{name}: not valid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except (ValueError, RecursionError) as e:  # e.g. an integer of thousands of digits
        raise InputError(field, f"{name}: not a usable JSON config ({str(e).splitlines()[0][:120]})") from None


def _nesting_depth(text: str) -> int:
    """Deepest bracket nesting outside strings (an upper bound on the parsed depth; cheap, no recursion)."""
    depth = deepest = 0
    for token in re.finditer(r'"(?:[^"\\]|\\.)*"|[\[{]|[\]}]', text):
        t = token.group()
        if t in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif t in "]}":
            depth -= 1
    return deepest


def load_from_hub(repo_id: str, revision: str | None = None) -> ModelSource:
    """Load `repo_id`'s config through transformers (its cache, HF_TOKEN, HF_HUB_OFFLINE all apply).

    Remote code is never run (`trust_remote_code=False`); failures become one-line `InputError`s.
    """
    import transformers  # lazy: the hub is the only path that needs it

    try:
        config = transformers.AutoConfig.from_pretrained(repo_id, revision=revision, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - every failure is mapped to a message below
        raise InputError("model", hub_error_message(repo_id, e)) from None
    return ModelSource(config.to_dict(), f"Hugging Face hub: {repo_id} @ {_commit_of(repo_id, revision)}")


def _commit_of(repo_id: str, revision: str | None) -> str:
    """The commit the config was read at (from the file transformers just cached), else the revision asked for."""
    from transformers.utils import hub

    try:
        path = hub.cached_file(repo_id, "config.json", revision=revision, local_files_only=True)
        return hub.extract_commit_hash(path, None) or revision or "main"
    except Exception:  # noqa: BLE001 - provenance is best effort; the config itself loaded fine
        return revision or "main"


def _causes(error: BaseException) -> list[BaseException]:
    """The exception and everything it was raised from (transformers wraps hub errors in OSError)."""
    chain, seen = [], set()
    while error is not None and id(error) not in seen:
        chain.append(error)
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return chain


def _status(error: BaseException) -> int | None:
    response = getattr(error, "response", None)
    return getattr(response, "status_code", None)


def hub_error_message(repo_id: str, error: BaseException) -> str:
    """Say in one line why `repo_id` could not be loaded and what to do instead."""
    names = {type(e).__name__ for e in _causes(error)}
    statuses = {_status(e) for e in _causes(error)} - {None}
    text = " ".join(str(e) for e in _causes(error)).lower()
    local = "download its config.json and pass the file's path"
    if "GatedRepoError" in names or statuses & {401, 403} or "gated repo" in text:
        return (f"{repo_id} is gated or private; run `huggingface-cli login` or set HF_TOKEN (after accepting its "
                f"licence on the model page), or {local}")
    if "trust_remote_code" in text or "custom code" in text:
        return (f"{repo_id} needs trust_remote_code, which llmem never enables (it would run the repository's "
                f"code); {local} if its architecture is one transformers supports natively")
    if "RevisionNotFoundError" in names or "not a valid git identifier" in text:
        return f"{repo_id}: that revision does not exist; check the branch, tag or commit"
    if "RepositoryNotFoundError" in names or 404 in statuses or "not a valid model identifier" in text:
        return f"{repo_id} was not found on the Hugging Face hub (check the spelling; private repos need HF_TOKEN)"
    offline = {"LocalEntryNotFoundError", "OfflineModeIsEnabled", "ConnectError", "ConnectionError",
               "TimeoutException", "NetworkError"}
    if names & offline or "couldn't connect" in text or "offline" in text:
        return (f"could not reach the Hugging Face hub to load {repo_id} (offline, and not in the local cache); "
                f"use a preset or a local config.json")
    if "does not recognize this architecture" in text or "unrecognized model" in text:
        return (f"{repo_id}: this transformers version does not know its model type; {local} "
                f"of a supported architecture, or upgrade transformers")
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return f"could not load {repo_id} from the Hugging Face hub: {first}"
