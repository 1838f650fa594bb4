"""Write the shipped derived tables (`llmem.derive.cache`): per preset, every table the workload below traces, as
`presets/<name>/derived/<cache file name>.json`, and `index.json` there naming each file's key and config.

Workload per preset (what a fresh server computes first): `llmem compare --model <name> --gpus N` for N in
`GPUS`, plus the preset's `EXTRA` compares. Each preset is traced into an empty cache directory with no shipped
table read, so a file is exactly what a fresh trace writes; the files of the presets not listed are left alone.

    python scripts/gen_derived_tables.py [--presets a,b] [--check]

`--check`: trace again into a temporary directory and compare with the shipped files (names and contents);
exit 1 on a difference or a missing or extra file. `--check --one`: only the smallest traced table of each preset
(of micro-batch 1 if any),
traced alone (`Derived._trace_and_fit`), and every file name recomputed from its key (the default test).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPUS = (1, 2, 4, 8, 16, 32, 64)
LORA_QV = ("--method", "lora", "--gpus", "8", "--precision", "bf16-mixed", "--lora-targets", "q_proj,v_proj")
EXTRA = {"qwen3-30b-a3b": (LORA_QV,), "mixtral-8x7b": (LORA_QV,)}  # the LoRA-under-TP-on-MoE compare


def default_presets() -> list[str]:
    from llmem.presets import list_presets

    names = [p.name for p in list_presets() if p.estimator == "derived"]
    return names + [p for p in EXTRA if p not in names]


def commands(name: str) -> list[list[str]]:
    return [["compare", "--model", name, "--gpus", str(n)] for n in GPUS] + \
        [["compare", "--model", name, *extra] for extra in EXTRA.get(name, ())]


def traced(name: str) -> dict[str, tuple[dict, list, object]]:
    """Every table the workload of preset `name` writes, traced afresh: file name -> (config, key, content)."""
    from llmem import cli
    from llmem.derive import cache

    written, store = {}, cache.store

    def recording(config, key, fitted):
        out = store(config, key, fitted)
        written[cache._path(config, key).name] = (config, list(key), out)
        return out

    shipped, cache.SHIPPED, cache.store = cache.SHIPPED, None, recording
    previous = os.environ.get("LLMEM_CACHE_DIR")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            os.environ["LLMEM_CACHE_DIR"] = tmp
            for argv in commands(name):
                try:
                    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                        cli.main(argv)
                except Exception as e:  # noqa: BLE001 - reported; the tables traced before it are kept
                    print(f"{' '.join(argv)}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    finally:
        cache.SHIPPED, cache.store = shipped, store
        if previous is None:
            os.environ.pop("LLMEM_CACHE_DIR", None)
        else:
            os.environ["LLMEM_CACHE_DIR"] = previous
    return written


def write(name: str, written: dict) -> None:
    directory = ROOT / "presets" / name / "derived"
    for old in directory.glob("*.json"):
        old.unlink()
    if not written:
        return
    directory.mkdir(exist_ok=True)
    configs = []
    for _, (config, _, _) in written.items():
        if config not in configs:
            configs.append(config)
    index = {file: {"key": key, "config": configs.index(config)} for file, (config, key, _) in sorted(written.items())}
    for file, (_, _, content) in written.items():
        (directory / file).write_text(json.dumps(content))
    (directory / "index.json").write_text(json.dumps({"configs": configs, "files": index}, indent=1) + "\n")


def as_key(value):
    """A key read from JSON as the tuple `Derived.key` makes (its lists were tuples)."""
    return tuple(as_key(v) for v in value) if isinstance(value, list) else value


def check_one(name: str) -> list[str]:
    """Every shipped file's name recomputed from its key and config, and the smallest traced table traced again."""
    from llmem.derive import cache
    from llmem.derive.tables import Derived

    directory = ROOT / "presets" / name / "derived"
    index = json.loads((directory / "index.json").read_text())
    bad = [f"{name}: {file} is not the name of its key (FORMAT or library versions changed)"
           for file, entry in index["files"].items()
           if cache._path(index["configs"][entry["config"]], as_key(entry["key"])).name != file]
    tables = [f for f, e in index["files"].items() if len(e["key"]) >= 6]
    if not tables:
        return bad
    file = min(tables, key=lambda f: (index["files"][f]["key"][4] != "single", (directory / f).stat().st_size))
    entry = index["files"][file]
    config = index["configs"][entry["config"]]
    fresh = json.loads(json.dumps(Derived(config, config["model_type"])._trace_and_fit(as_key(entry["key"]))))
    if fresh != json.loads((directory / file).read_text()):
        bad.append(f"{name}: {file} ({entry['key']}) differs from a fresh trace")
    return bad


def check(name: str) -> list[str]:
    directory = ROOT / "presets" / name / "derived"
    shipped = {p.name for p in directory.glob("*.json")} - {"index.json"}
    written = traced(name)
    bad = [f"{name}: {f} missing" for f in sorted(set(written) - shipped)]
    bad += [f"{name}: {f} not written by the workload" for f in sorted(shipped - set(written))]
    bad += [f"{name}: {f} differs" for f in sorted(shipped & set(written))
            if json.loads((directory / f).read_text()) != written[f][2]]
    return bad


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--one", action="store_true")
    args = ap.parse_args()
    names = args.presets.split(",") if args.presets else default_presets()
    bad = []
    for name in names:
        if args.check:
            problems = check_one(name) if args.one else check(name)
            print(f"{name}: {'current' if not problems else 'STALE'}", flush=True)
            bad += problems
        else:
            written = traced(name)
            write(name, written)
            size = sum(p.stat().st_size for p in (ROOT / "presets" / name / "derived").glob("*.json")) \
                if written else 0
            print(f"{name}: {len(written)} files, {size:,} bytes", flush=True)
    print("\n".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
