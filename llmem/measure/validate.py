"""Validation grids: estimate vs measure for every row of a suite; CSV, markdown table and ACCURACY.md.

Suite file (YAML or JSON):

    models:                       # name -> an inline HF config dict, or a preset name / config.json path / hub id
      llama-gqa: {model_type: llama, hidden_size: 64, ...}
    defaults: {batch_size: 1, seq_len: 64, precision: fp32}
    rows:
      - {id: llama-ddp, model: llama-gqa, gpus: 2, zero: 0}

Rows are grouped by world size: all single-rank rows run in one process, all rows of one world size inside one
torchrun job (each row isolated; results appended as they come). A job that dies loses only the rows it had not
finished; those are re-run one by one, and a row that fails alone is reported as failed — the grid goes on.
"""

from __future__ import annotations

import csv
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from llmem.errors import InputError
from llmem.measure.schemes import scheme_summary
from llmem.options import PLAN_OPTIONS
from llmem.plan import TrainingPlan

# what a suite row may set: the plan's options but the device (a column of its own) and those that need CUDA
PLAN_FIELDS = tuple(o.name for o in PLAN_OPTIONS if o.name != "device" and not o.cuda_only)
# Pass criteria of the accuracy suite: |estimate - measured| / measured.
TOLERANCE_SINGLE = 0.01  # every row of the suite; the bound README and the issues state
TOLERANCE_MULTI = 0.01

CSV_COLUMNS = ["id", "model", "model_type", "scheme", *PLAN_FIELDS, "device", "estimated_bytes", "measured_bytes",
               "per_rank", "error_pct", "status", "message", "with_scratch_bytes", "torch", "transformers"]


@dataclass
class Row:
    id: str
    model: str
    config: dict
    plan: dict  # PLAN_FIELDS only
    steps: int = 2

    def training_plan(self, device: str) -> TrainingPlan:
        return TrainingPlan(**self.plan, device=device)

    def job_row(self) -> dict:
        return {"id": self.id, "config": self.config, "plan": self.plan, "steps": self.steps}


@dataclass
class Suite:
    rows: list[Row]
    path: str = ""
    extra: dict = field(default_factory=dict)


MAX_SUITE_BYTES = 4 * 1024 * 1024  # a suite is a few kilobytes of YAML


def _yaml_loader():
    """PyYAML's SafeLoader refusing aliases (`*name`): a few lines of them expand to billions of nodes."""
    import yaml

    class NoAliasSafeLoader(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                raise InputError("suite", "YAML aliases (*name) are not allowed in a suite; write the values out")
            return super().compose_node(parent, index)

    return NoAliasSafeLoader


def _load_file(path: Path) -> dict:
    try:
        if path.stat().st_size > MAX_SUITE_BYTES:
            raise InputError("suite", f"{path.name} is over {MAX_SUITE_BYTES // 2**20} MiB; a suite is a few KiB")
        text = path.read_bytes().decode("utf-8-sig")
    except OSError as exc:
        raise InputError("suite", f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise InputError("suite", f"{path.name} is not UTF-8 text (byte {exc.start}); a suite is YAML or JSON") \
            from None
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.load(text, Loader=_yaml_loader())  # noqa: S506 - a SafeLoader subclass
        else:
            from llmem.sources import parse_json

            data = parse_json(text, path.name, field="suite")
    except InputError:
        raise
    except Exception as exc:  # noqa: BLE001 - any parser failure (incl. recursion on deep nesting) is one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        raise InputError("suite", f"{path.name} is not valid {path.suffix.lstrip('.') or 'JSON'}: {first}") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise InputError("suite", f"{path.name} needs a 'rows' list")
    return data


def _resolve(name: str, models: dict) -> dict:
    spec = models.get(name, name)
    if isinstance(spec, dict):
        return _check_config(spec, name)
    if not isinstance(spec, str):
        raise InputError("suite", f"model {name!r}: expected an inline config or a preset/path/hub id")
    from llmem.sources import resolve_model

    return resolve_model(spec).config


def _check_config(config: dict, name: str) -> dict:
    """An inline config: a `model_type`, and for the estimator's families sizes it accepts (a bad size named now,
    not as a failed row after a measurement started)."""
    if not isinstance(config.get("model_type"), str) or not config["model_type"]:
        raise InputError("suite", f"model {name!r}: an inline config needs a \"model_type\"")
    try:
        from llmem.families import FAMILIES
        from llmem.spec import ModelSpec
    except ImportError:
        return config
    if config["model_type"] in FAMILIES:
        try:
            ModelSpec.from_config(config)
        except InputError as exc:
            raise InputError("suite", f"model {name!r}: {exc}") from None
    return config


def _steps(value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().isdigit():
        raise InputError("steps", f"must be a whole number of at least 1, got {value!r}")
    if int(value) < 1:
        raise InputError("steps", f"must be at least 1, got {value}")
    return int(value)


def _mapping(data: dict, key: str) -> dict:
    value = data.get(key) or {}
    if not isinstance(value, dict):
        raise InputError("suite", f"'{key}' must be a mapping (name: value), got a {type(value).__name__}")
    return value


def load_suite(path: str | Path) -> Suite:
    path = Path(path)
    data = _load_file(path)
    models, defaults = _mapping(data, "models"), _mapping(data, "defaults")
    rows, seen = [], set()
    for i, raw in enumerate(data["rows"]):
        if not isinstance(raw, dict) or "model" not in raw:
            raise InputError("suite", f"row {i + 1} needs a 'model'")
        merged = {**defaults, **raw}
        unknown = set(merged) - {*PLAN_FIELDS, "id", "model", "steps"}
        if unknown:
            raise InputError("suite", f"row {i + 1}: unknown field(s) {', '.join(sorted(map(str, unknown)))}")
        row_id = str(merged.get("id") or f"row{i + 1}")
        if row_id in seen:
            raise InputError("suite", f"row id {row_id!r} appears twice")
        seen.add(row_id)
        plan = {k: merged[k] for k in PLAN_FIELDS if k in merged}
        TrainingPlan(**plan)  # validate now: a bad row names its field before anything runs
        model = merged["model"]
        if not isinstance(model, str):
            raise InputError("suite", f"row {i + 1}: 'model' must be a name, path or hub id")
        rows.append(Row(row_id, model, _resolve(model, models), plan, _steps(merged.get("steps", 2))))
    return Suite(rows, str(path))


def check_device(device: str) -> None:
    """`--device cuda` needs a CUDA build of torch and a visible GPU; say so before any worker starts."""
    if str(device) != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise InputError("device", f"CUDA is not available here (torch {torch.__version__}: "
                         f"{'no GPU visible' if torch.version.cuda else 'a CPU-only build'}); use --device cpu")


def check_host_memory(rows: list[Row], device: str) -> None:
    """Refuse a grid with a row whose CPU run cannot fit in the memory available now (preflight.py)."""
    from llmem.measure.preflight import host_memory_problem

    for row in rows:
        problem = host_memory_problem(row.config, row.training_plan(device))
        if problem:
            raise InputError("suite", f"row {row.id!r}: {problem}")


def estimate_row(row: Row, device: str) -> tuple[int | None, str]:
    """(estimated peak bytes, message). The estimator is imported lazily: measuring works without it."""
    try:
        from llmem.estimate import estimate
        from llmem.spec import ModelSpec
    except ImportError as exc:
        return None, f"no estimator: {exc}"
    try:
        result = estimate(ModelSpec.from_config(row.config), row.training_plan(device))
    except InputError as exc:
        return None, f"estimate: {exc}"
    return int(result.peak_bytes), ""


def measure_rows(rows: list[Row], device: str, jsonl: Path, log=print, resume: bool = False) -> dict[str, dict]:
    """Measure every row; returns id -> result (with 'error' for failed rows). Appends to `jsonl` as it goes."""
    from llmem.measure import counting
    from llmem.measure.launch import read_jsonl, run_job

    if device == "cpu":
        counting.available()  # build the extension once, before any worker starts
    if not resume:
        jsonl.unlink(missing_ok=True)
    # With resume, rows an earlier (interrupted) run measured with the same plan are kept, not re-run.
    plans = {r.id: r.plan for r in rows}
    done = {r["id"]: r for r in read_jsonl(jsonl) if "error" not in r and plans.get(r["id"]) == r.get("plan")}
    todo = [r for r in rows if r.id not in done]
    by_world: dict[int, list[Row]] = {}
    for r in todo:
        by_world.setdefault(r.training_plan(device).gpus, []).append(r)
    for world, group in sorted(by_world.items()):
        t0 = time.perf_counter()
        results, err = run_job([r.job_row() for r in group], world, device, jsonl)
        for res in results:
            done[res["id"]] = res
        log(f"{len(group)} row(s) on {world} process(es): {time.perf_counter() - t0:.1f} s"
            + (f" ({err})" if err else ""))
        missing = [r for r in group if r.id not in done]
        for r in missing:  # the job died: re-run each unfinished row on its own
            results, err = run_job([r.job_row()], world, device, jsonl)
            if results:
                done[r.id] = results[0]
            else:
                failed = {"id": r.id, "device": device, "plan": r.plan, "world_size": world,
                          "error": err or "the run produced no result"}
                with open(jsonl, "a") as fh:
                    fh.write(json.dumps(failed) + "\n")
                done[r.id] = failed
            log(f"re-ran {r.id} alone: {'ok' if 'error' not in done[r.id] else done[r.id]['error']}")
    return done


def remeasure_read_high(rows: list[Row], measured: dict[str, dict], device: str, log=print,
                        estimates: dict | None = None) -> None:
    """A multi-rank CPU row read above its estimate beyond the tolerance is measured again alone and the lower peak
    kept, as the multi-rank tests do: gloo's threads free some buffers at moments that vary with load, which only
    raises a peak (docs/notes/2026-11-22-gloo-fence-repeatability.md). Both figures are logged."""
    from llmem.measure.launch import run_job
    for row in rows:
        plan, res = row.training_plan(device), measured.get(row.id, {})
        est, _ = (estimates or {}).get(row.id) or estimate_row(row, device) \
            if device == "cpu" and plan.gpus > 1 and "peak_bytes" in res else (None, "")
        if est is None or res["peak_bytes"] * (1 - TOLERANCE_MULTI) <= est:
            continue
        again = (run_job([row.job_row()], plan.gpus, device)[0] or [{}])[0]
        measured[row.id] = min(res, again, key=lambda r: r.get("peak_bytes", float("inf")))
        log(f"{row.id} read {res['peak_bytes']} B, {again.get('peak_bytes')} B alone: kept the lower")


def result_rows(suite: Suite, measured: dict[str, dict], device: str, estimates: dict | None = None) -> list[dict]:
    out = []
    for row in suite.rows:
        plan = row.training_plan(device)
        res = measured.get(row.id, {"error": "not measured"})
        est, est_msg = (estimates or {}).get(row.id) or estimate_row(row, device)
        meas = res.get("peak_bytes")
        rec = {"id": row.id, "model": row.model, "model_type": row.config.get("model_type", ""),
               "scheme": plan.scheme.value, **plan.to_dict(), "estimated_bytes": est, "measured_bytes": meas,
               "per_rank": " ".join(str(b) for b in res.get("per_rank", [])), "error_pct": None,
               "with_scratch_bytes": res.get("peak_bytes_with_scratch"),
               "torch": res.get("torch", ""), "transformers": res.get("transformers", "")}
        if "error" in res:
            rec["status"], rec["message"] = "failed", res["error"]
        elif est is None:
            rec["status"], rec["message"] = "no estimate", est_msg
        else:
            rec["error_pct"] = round(100.0 * (est - meas) / meas, 3)
            limit = 100 * (TOLERANCE_SINGLE if plan.gpus == 1 else TOLERANCE_MULTI)
            rec["status"] = "ok" if abs(rec["error_pct"]) <= limit else "over tolerance"
            rec["message"] = ""
        out.append(rec)
    return out


def write_csv(records: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for rec in records:
            writer.writerow({k: ("" if rec.get(k) is None else rec.get(k)) for k in CSV_COLUMNS})


def _mib(n) -> str:
    return "" if n is None else f"{n / 2**20:.3f}"


def _pct(x) -> str:
    return "" if x is None else f"{x:+.2f}%"


def _every(r: dict) -> str:
    """`--ckpt-every K` next to the checkpointing column when K > 1."""
    k = r.get("ckpt_every")
    return f" every {k}" if k not in (None, "", 1, "1") else ""


def markdown_table(records: list[dict]) -> str:
    lines = ["| id | model | scheme | gpus | tp | zero | b×s | precision | optimizer | ckpt | attn | estimate MiB | "
             "measured MiB | error | status | with kernel scratch MiB |", "|" + "---|" * 16]
    for r in records:
        status = r["status"] if not r["message"] else f"{r['status']}: {r['message']}"
        lines.append(f"| {r['id']} | {r['model']} | {r['scheme']} | {r['gpus']} | {r['tp']} | {r['zero']} | "
                     f"{r['batch_size']}×{r['seq_len']} | {r['precision']} | {r['optimizer']}/{r['optimizer_impl']} |"
                     f" {r['grad_ckpt']}{_every(r)} | {r['attn']} | {_mib(r['estimated_bytes'])} |"
                     f" {_mib(r['measured_bytes'])} |"
                     f" {_pct(r['error_pct'])} | {status.replace('|', '/')} | {_mib(r.get('with_scratch_bytes'))} |")
    return "\n".join(lines)


def summary_table(records: list[dict]) -> str:
    lines = ["| scheme | rows | compared | failed | mean abs. error | worst error |", "|---|---|---|---|---|---|"]
    for s in scheme_summary(records):
        mae = "" if s["mae_pct"] is None else f"{s['mae_pct']:.2f}%"
        lines.append(f"| {s['label']} | {s['rows']} | {s['compared']} | {s['failed']} | {mae} | "
                     f"{_pct(s['worst_pct'])} |")
    return "\n".join(lines)


def accuracy_markdown(records: list[dict], suite_path: str, device: str, command: str) -> str:
    from llmem.measure.machine import describe, summary

    torch_v = next((r["torch"] for r in records if r["torch"]), "")
    tf_v = next((r["transformers"] for r in records if r["transformers"]), "")
    return "\n".join([
        "# Accuracy: estimate vs measured peak",
        "",
        f"Generated by `{command}` — do not edit by hand.",
        "",
        f"- suite: `{suite_path}` ({len(records)} configurations)",
        f"- device profile: `{device}`; torch {torch_v}, transformers {tf_v}",
        "- measured: per-rank peak of allocated tensor bytes over two iterations after the model was built and "
        "wrapped (docs/DESIGN.md §1); on CPU, a counting wrapper of the CPU allocator that leaves out kernel "
        "scratch (memory an operator's own CPU kernel allocates and frees before it returns: it depends on the "
        "instruction set and has no CUDA counterpart; `llmem/measure/kernels.py`), so the figures are the same on "
        "any x86-64 CPU; on CUDA, `torch.cuda.max_memory_allocated()`; multi-rank figures are the maximum over ranks",
        f"- machine: {summary(describe())}" if device == "cpu" else "- machine: CUDA device",
        "- error = (estimate − measured) / measured; tolerance "
        f"{100 * TOLERANCE_SINGLE:.0f}% single-rank, {100 * TOLERANCE_MULTI:.0f}% multi-rank",
        "",
        "## Per scheme",
        "",
        summary_table(records),
        "",
        "## Every configuration",
        "",
        markdown_table(records),
        "",
    ])


def validate(suite_path: str | Path, device: str = "cpu", out_dir: str | Path = "out/validate",
             accuracy_md: str | Path | None = None, command: str = "", log=print, resume: bool = False) -> list[dict]:
    suite = load_suite(suite_path)
    for row in suite.rows:
        row.training_plan(device)  # validates the device too
    check_device(device)
    check_host_memory(suite.rows, device)
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        what = "is a file, not a directory" if out.exists() else f"cannot be created ({exc.strerror or exc})"
        raise InputError("out", f"{out} {what}; give a directory for validate.csv and validate.md") from None
    measured = measure_rows(suite.rows, device, out / "measured.jsonl", log, resume)
    estimates = {row.id: estimate_row(row, device) for row in suite.rows}  # each once: a pure function of the row
    remeasure_read_high(suite.rows, measured, device, log, estimates)
    records = result_rows(suite, measured, device, estimates)
    write_csv(records, out / "validate.csv")
    (out / "validate.md").write_text(summary_table(records) + "\n\n" + markdown_table(records) + "\n")
    if accuracy_md:
        cmd = command or f"python -m llmem validate --suite {suite_path} --device {device}"
        Path(accuracy_md).write_text(accuracy_markdown(records, str(suite_path), device, cmd))
    return records
