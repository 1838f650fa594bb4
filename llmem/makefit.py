"""Make it fit: the cheapest single changes that make a plan fit its GPUs, ranked, each with its new peak; the fewest
GPUs of a type that fit; and a GPU type × GPU count grid.

Pure library code (no streamlit, no torch): every number comes from `llmem.estimate` and `llmem.compare`, sizes are
bytes. A change is tried on the plan's own strategy (`any_strategy=False`), or, when the user compares all
strategies, on whichever strategy fits with the least communication (`llmem.compare.COMMUNICATION_ORDER`).

The changes, cheapest first (`KINDS`): a smaller micro-batch (grad-accum keeps the tokens per step), activation
checkpointing (every K-th layer, the largest K that fits: the least recompute), another ZeRO stage or TP degree on
the same GPUs, LoRA, QLoRA (nf4 base, pure compute dtype), offload to host memory, more GPUs of the same type, a
larger GPU type.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from llmem.compare import COMMUNICATION_ORDER, OnCapacity, max_batch_size, strategies
from llmem.errors import InputError
from llmem.estimate import Estimate, estimate, validate_plan_for_model
from llmem.gpus import GpuType, list_gpus
from llmem.plan import GradCkpt, Method, Offload, Optimizer, Precision, Quant, TrainingPlan
from llmem.spec import ModelSpec

KINDS = ("micro-batch", "checkpointing", "strategy", "lora", "qlora", "offload", "more GPUs", "larger GPU")
MAX_SEARCH_GPUS = 4096
GRID_COUNTS = (1, 2, 4, 8, 16, 32, 64)
@dataclass(frozen=True)
class Fix(OnCapacity):
    """One change that fits: its kind (`KINDS`), what it changes in words, the fields it sets (`TrainingPlan`
    fields, plus `gpu_type` for a larger GPU), the plan it runs (strategy included) and its estimate."""

    kind: str
    label: str
    changes: dict
    plan: TrainingPlan
    estimate: Estimate = field(repr=False)
    capacity_bytes: int
    gpu: GpuType
    cost: str


def pure_precision(precision: Precision) -> Precision:
    """The pure dtype a mixed precision computes in (bf16-mixed -> bf16): what a QLoRA base is built in."""
    return precision.pure


def _order(plans: Iterable[TrainingPlan]) -> list[TrainingPlan]:
    return sorted(plans, key=lambda p: (COMMUNICATION_ORDER.index(p.scheme), p.tp))


def _candidates(spec: ModelSpec, plan: TrainingPlan, any_strategy: bool) -> list[TrainingPlan]:
    """The plans a change is tried on: its own strategy, or every valid one (least communication first)."""
    if not any_strategy:
        return [plan]
    return _order(strategies(spec, plan))


def fitting(spec: ModelSpec, plan: TrainingPlan, capacity: int, any_strategy: bool) -> tuple | None:
    """(plan, estimate) of the first candidate strategy whose device total fits `capacity`, or None."""
    for candidate in _candidates(spec, plan, any_strategy):
        try:
            est = estimate(spec, candidate)
        except InputError:
            continue
        if est.device_total_bytes <= capacity:
            return candidate, est
    return None


def _try(spec, plan, capacity, any_strategy, **changes) -> tuple | None:
    """`fitting` for the plan with `changes`; a change the plan's strategy refuses is tried on any strategy."""
    try:
        changed = plan.with_(**changes)
    except InputError:
        if any_strategy:
            return None
        try:
            changed = plan.with_(tp=1, zero=0, **changes)
        except InputError:
            return None
        any_strategy = True
    try:
        return fitting(spec, changed, capacity, any_strategy)
    except InputError:
        return None


def _micro_batch(spec, plan, capacity, any_strategy):
    if plan.batch_size == 1:
        return None
    best = None
    for candidate in _candidates(spec, plan, any_strategy):
        try:
            b = max_batch_size(spec, candidate, capacity)
        except InputError:
            continue
        if 1 <= b < plan.batch_size and (best is None or b > best[0]):
            best = (b, candidate)
    if best is None:
        return None
    b, candidate = best
    accum = plan.grad_accum * math.ceil(plan.batch_size / b)
    for changes in ({"batch_size": b, "grad_accum": accum}, {"batch_size": b}):  # keep the tokens per step if it fits
        found = _try(spec, candidate, capacity, False, **changes)
        if found:
            kept = "grad_accum" in changes and accum != plan.grad_accum
            return (f"micro-batch {plan.batch_size} → {b}" + (f", grad-accum {plan.grad_accum} → {accum}" if kept
                                                              else ""), changes, found,
                    "same tokens per step, more micro-steps" if kept else "fewer tokens per step")
    return None


def _checkpointing(spec, plan, capacity, any_strategy):
    """Full checkpointing on every K-th layer, the largest K that fits (binary search: memory grows with K)."""
    if plan.grad_ckpt is GradCkpt.FULL and plan.ckpt_every == 1:
        return None
    top = plan.ckpt_every - 1 if plan.grad_ckpt is GradCkpt.FULL else max(spec.num_layers, 1)
    found = _try(spec, plan, capacity, any_strategy, grad_ckpt=GradCkpt.FULL, ckpt_every=1)
    if not found:
        return None
    lo, hi = 1, top
    while lo < hi:
        mid = (lo + hi + 1) // 2
        at = _try(spec, plan, capacity, any_strategy, grad_ckpt=GradCkpt.FULL, ckpt_every=mid)
        if at:
            lo, found = mid, at
        else:
            hi = mid - 1
    label = "activation checkpointing on every layer" if lo == 1 else f"activation checkpointing every {lo} layers"
    return label, {"grad_ckpt": GradCkpt.FULL, "ckpt_every": lo}, found, "about one extra forward of compute"


def _strategy(spec, plan, capacity, any_strategy):
    if any_strategy or plan.gpus == 1:
        return None
    others = [p for p in _order(strategies(spec, plan)) if (p.tp, p.zero) != (plan.tp, plan.zero)]
    for other in others:
        found = fitting(spec, other, capacity, False)
        if found:
            label = other.strategy_label if other.tp == 1 else f"{other.strategy_label} (TP={other.tp})"
            return label, {"tp": other.tp, "zero": other.zero}, found, "more communication"
    return None


def _lora(spec, plan, capacity, any_strategy):
    if plan.method is not Method.FULL:
        return None
    found = _try(spec, plan, capacity, any_strategy, method=Method.LORA, offload=Offload.NONE)
    changes = {"method": Method.LORA, "offload": Offload.NONE}
    return found and (f"LoRA r={plan.lora_rank}", changes, found, "trains adapters, not every weight")


def _qlora(spec, plan, capacity, any_strategy):
    if plan.method is Method.QLORA:
        return None
    changes = {"method": Method.QLORA, "quant": Quant.NF4, "precision": pure_precision(plan.precision),
               "offload": Offload.NONE}
    found = _try(spec, plan, capacity, any_strategy, **changes)
    return found and (f"QLoRA nf4 r={plan.lora_rank} ({changes['precision']})", changes, found,
                      "4-bit frozen base, adapters trained")


def _offload(spec, plan, capacity, any_strategy):
    if plan.offload is not Offload.NONE or plan.method is not Method.FULL:
        return None
    if plan.gpus == 1:
        if plan.optimizer not in (Optimizer.ADAMW, Optimizer.SGD):
            return None
        changes = {"offload": Offload.OPTIMIZER}
    else:
        changes = {"offload": Offload.OPTIMIZER_PARAMS, "tp": 1, "zero": 3}
    found = _try(spec, plan, capacity, False, **changes)
    return found and (f"offload {changes['offload']} to host memory", changes, found,
                      "host RAM and a CPU optimizer step (slower)")


def on_gpus(plan: TrainingPlan, n: int) -> TrainingPlan | None:
    """The plan on `n` GPUs with TP 1 and the first ZeRO stage it runs with (3, 2, 1, 0), or None."""
    for zero in (0,) if n == 1 else (3, 2, 1, 0):
        try:
            return plan.with_(gpus=n, tp=1, zero=zero)
        except InputError:
            continue
    return None


def _wide(spec: ModelSpec, plan: TrainingPlan, n: int) -> list[TrainingPlan]:
    """The strategies that hold the least per GPU on `n` GPUs: ZeRO-3 (else the first stage the plan runs with),
    and TP within a node (2, 4, 8) over FSDP2."""
    base = on_gpus(plan, n)
    if base is None:
        return []
    out = [base]
    for tp in (2, 4, 8):
        if n % tp == 0:
            try:
                candidate = plan.with_(gpus=n, tp=tp, zero=0 if tp == n else 3)
                validate_plan_for_model(spec, candidate)
            except InputError:
                continue
            out.append(candidate)
    return out


def min_gpus(spec: ModelSpec, plan: TrainingPlan, capacity: int, limit: int = MAX_SEARCH_GPUS) -> tuple | None:
    """(GPU count, plan, estimate): the fewest GPUs of `capacity` bytes on which some strategy fits, or None up to
    `limit`. Doubling finds a fitting count, then bisection the fewest (per-GPU memory falls with the count); the
    doubling stops once the smallest per-GPU total falls by less than 2% a step (what no GPU count divides:
    activations, a whole replica)."""
    def at(n: int) -> tuple:
        smallest = None
        for candidate in _wide(spec, plan, n):
            est = estimate(spec, candidate)
            if est.device_total_bytes <= capacity:
                return (candidate, est), est.device_total_bytes
            smallest = min(smallest or est.device_total_bytes, est.device_total_bytes)
        return None, smallest

    n, (found, total) = 1, at(1)
    while not found and n < limit:
        n = min(n * 2, limit)
        found, smaller = at(n)
        if not found and (total is None or smaller is None or smaller > 0.98 * total):
            return None
        total = smaller
    if not found:
        return None
    lo, hi = n // 2 + 1, n
    while lo < hi:
        mid = (lo + hi) // 2
        here = at(mid)[0]
        if here:
            hi, found = mid, here
        else:
            lo = mid + 1
    return (hi, *found)


def _more_gpus(spec, plan, capacity, any_strategy):
    found = min_gpus(spec, plan, capacity)
    if not found or found[0] <= plan.gpus:
        return None
    n, fit_plan, est = found
    return f"{n} GPUs ({plan.gpus} → {n})", {"gpus": n}, (fit_plan, est), "more GPUs to rent"


def _larger_gpu(spec, plan, capacity, any_strategy, gpus: Iterable[GpuType]):
    for gpu in sorted((g for g in gpus if g.memory_bytes > capacity), key=lambda g: (g.memory_bytes, g.key)):
        found = fitting(spec, plan, gpu.memory_bytes, any_strategy)
        if found:
            return gpu, found
    return None


def make_fit(spec: ModelSpec, plan: TrainingPlan, gpu: GpuType, *, any_strategy: bool = False,
             gpus: Iterable[GpuType] | None = None) -> list[Fix]:
    """The single changes that make `plan` fit `gpu`, cheapest first (`KINDS`), each once (its cheapest form).
    Empty when the plan already fits or nothing fits."""
    capacity = gpu.memory_bytes
    if fitting(spec, plan, capacity, any_strategy):
        return []
    fixes = []
    for kind, find in zip(KINDS[:6], (_micro_batch, _checkpointing, _strategy, _lora, _qlora, _offload),
                          strict=True):
        found = find(spec, plan, capacity, any_strategy)
        if found:
            label, changes, (fit_plan, est), cost = found
            fixes.append(Fix(kind, label, changes, fit_plan, est, capacity, gpu, cost))
    more = _more_gpus(spec, plan, capacity, any_strategy)
    if more:
        label, changes, (fit_plan, est), cost = more
        fixes.append(Fix("more GPUs", label, changes, fit_plan, est, capacity, gpu, cost))
    larger = _larger_gpu(spec, plan, capacity, any_strategy, list_gpus() if gpus is None else gpus)
    if larger:
        other, (fit_plan, est) = larger
        fixes.append(Fix("larger GPU", f"{other.name}", {"gpu_type": other.key}, fit_plan, est,
                         other.memory_bytes, other, "a larger GPU to rent"))
    return fixes


def fit_grid(spec: ModelSpec, plan: TrainingPlan, gpus: Iterable[GpuType] | None = None,
             counts: Iterable[int] = GRID_COUNTS) -> list[dict]:
    """For each GPU count, the smallest device total over its strategies (one estimate set per count, whatever the
    GPU type), and per GPU type the headroom in bytes (negative: short) and the verdict (fits at the high end, risky,
    no: `Estimate.verdict`). Rows: {"gpus", "strategy", "device_total_bytes", "headroom": {gpu key: bytes},
    "verdict": {gpu key: str}}."""
    gpus = list_gpus() if gpus is None else list(gpus)
    rows = []
    for n in counts:
        base = on_gpus(plan, n)
        if base is None:
            continue
        best = None
        for candidate in strategies(spec, base):
            try:
                est = estimate(spec, candidate)
            except InputError:
                continue
            if best is None or est.device_total_bytes < best[1].device_total_bytes:
                best = (candidate, est)
        if best is None:
            continue
        total = best[1].device_total_bytes
        rows.append({"gpus": n, "strategy": best[0].strategy_label, "device_total_bytes": total,
                     "headroom": {g.key: g.memory_bytes - total for g in gpus},
                     "verdict": {g.key: best[1].verdict(g.memory_bytes) for g in gpus}})
    return rows
