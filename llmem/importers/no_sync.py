"""Whether an imported run accumulates without synchronizing (`--no-sync`). The HF Trainer runs every micro-step of
`gradient_accumulation_steps` but the last under `accelerator.no_sync` (DDP/FSDP1 `no_sync()`, FSDP2
`set_requires_gradient_sync(False)`) unless `accelerator_config.gradient_accumulation_kwargs.sync_each_batch` is
true, and never under DeepSpeed (transformers 5.23 trainer.py:1896-1907). The file's setting is known when it is
read (`hint`); whether it applies (several GPUs, data parallelism, not DeepSpeed) only once every file and flag is
merged (`resolve`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from llmem.errors import InputError
from llmem.importers.core import Line, Reader

SYNC_EACH_BATCH = "accelerator_config.gradient_accumulation_kwargs.sync_each_batch"
ACCUMULATE = ("the HF Trainer runs the first K-1 micro-steps under accelerate's no_sync (sync_each_batch false, "
              "accelerate's default)")


def hint(r: Reader) -> Line | None:
    """A Trainer file's no-sync setting: sync_each_batch true → off; else on where accumulation runs (the key read
    either way, so `accelerator_config` is not reported unread)."""
    each = r.flag(SYNC_EACH_BATCH)
    if each is True:
        return Line(r.name, SYNC_EACH_BATCH, "true", "no_sync", False, "every micro-step synchronizes")
    accum = r.get("gradient_accumulation_steps")
    if isinstance(accum, int) and not isinstance(accum, bool) and accum > 1:
        return Line(r.name, "gradient_accumulation_steps", str(accum), "no_sync", True, ACCUMULATE)
    return None


def resolve(result, line: Line | None, explicit: Mapping[str, object]) -> None:
    """Apply the last Trainer file's hint to the merged options where the plan takes it (else one ignored line saying
    why: one GPU, DeepSpeed, or not modelled); the command line's --no-sync wins."""
    if line is None:
        return
    if "no_sync" in explicit:
        result.ignored.append(replace(line, why=f"{line.why}; --no-sync on the command line sets it"))
        return
    if line.setting is False:
        result.used.append(line)
        result.options["no_sync"] = False
        return
    why = "DeepSpeed accumulates by itself (the Trainer enters no no_sync under DeepSpeed)" if _deepspeed(result) \
        else _refusal({**result.options, **explicit, "no_sync": True})
    if why is None:
        result.used.append(line)
        result.options["no_sync"] = True
    else:
        result.ignored.append(replace(line, why=f"{line.why}; not applied: {why}"))


def _deepspeed(result) -> bool:
    """Whether a DeepSpeed config was read (a DeepSpeed JSON, a Trainer's inline one, accelerate's plugin), also
    when --engine torch maps it to the nearest PyTorch program: the Trainer runs DeepSpeed's own accumulation."""
    from llmem.importers import deepspeed

    return any(fmt == deepspeed.NAME for _, fmt in result.files) or any(
        "deepspeed" in line.key or line.key.startswith("zero_optimization") or str(line.value).upper() == "DEEPSPEED"
        for line in result.used + result.ignored)


def _refusal(options: dict) -> str | None:
    """Why a plan of these options does not take --no-sync (None: it does). The plan without it is made first: when
    that is refused, the estimate reports its own error and no_sync is left off."""
    from llmem.plan import TrainingPlan

    fields = {k: v for k, v in options.items() if k in TrainingPlan.__dataclass_fields__}
    try:
        TrainingPlan(**{**fields, "no_sync": False})
    except (InputError, TypeError, ValueError):
        return "the plan as imported is refused (its error follows)"
    try:
        TrainingPlan(**fields)
    except InputError as e:
        return str(e).split(": ", 1)[-1]
    return None
