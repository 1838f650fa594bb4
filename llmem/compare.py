"""Every valid strategy for a GPU count and capacity: per-GPU peak, fit, headroom, largest micro-batch, and a
recommendation.

Other fine-tuning methods can stand beside the chosen one (`variants`: e.g. full fine-tuning with ZeRO-3 on 8 GPUs
next to LoRA on 1): each variant is the plan with some fields changed, on the plan's GPU count when the variant
runs there, else on one GPU. The recommendation stays among the chosen plan's own rows — another method trains
something else, so it is shown for comparison, not silently preferred.

The largest micro-batch is solved, not scanned: every phase of `estimate.iteration_phases` is linear in the
micro-batch (activations and logits scale with tokens; eager attention's seq² term scales with the batch too), so
each phase's total is c + k·b and the device total is a fixed function of the peak. Two evaluations give c and k per
phase; the answer is the smallest (capacity − c) / k over phases, confirmed by one more estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmem.components import outside
from llmem.errors import InputError
from llmem.estimate import FITS, RISK_FIX, Estimate, estimate, plan_phases, validate_plan_for_model
from llmem.plan import MAX_TOKENS, Device, Loss, Method, Offload, Scheme, TrainingPlan
from llmem.spec import ModelSpec
from llmem.units import format_gib

# Less communication first: the tie-break of the recommendation.
COMMUNICATION_ORDER = [Scheme.SINGLE, Scheme.DDP, Scheme.ZERO1, Scheme.ZERO2, Scheme.ZERO3, Scheme.TP,
                       Scheme.TP_ZERO3, Scheme.PP]  # --pp: only ever compared with itself


class OnCapacity:
    """An estimate against a GPU's capacity (`estimate`, `capacity_bytes` fields of the dataclass using it)."""

    estimate: Estimate
    capacity_bytes: int

    @property
    def peak_bytes(self) -> int:
        return self.estimate.peak_bytes

    @property
    def device_total_bytes(self) -> int:
        return self.estimate.device_total_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.capacity_bytes - self.device_total_bytes

    @property
    def device_total_high_bytes(self) -> int:
        """The high end of the device total (`Estimate.device_total_bytes_range`)."""
        return self.estimate.device_total_bytes_range[1]

    @property
    def verdict(self) -> str:
        """fits (at the high end), risky (only at the low end) or no (`Estimate.verdict`)."""
        return self.estimate.verdict(self.capacity_bytes)


@dataclass(frozen=True)
class Row(OnCapacity):
    plan: TrainingPlan
    estimate: Estimate
    capacity_bytes: int
    max_batch_size: int
    variant: bool = False  # a row of another method (`variants`), shown for comparison only

    @property
    def scheme(self) -> Scheme:
        return self.plan.scheme

    @property
    def tp(self) -> int:
        return self.plan.tp

    @property
    def zero(self) -> int:
        return self.plan.zero

    @property
    def label(self) -> str:
        strategy = self.plan.strategy_label if self.tp == 1 else f"{self.plan.strategy_label} (TP={self.tp})"
        method = method_label(self.plan)
        return strategy if not method else f"{method} · {strategy}"

    @property
    def fits(self) -> bool:
        return self.headroom_bytes >= 0

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimizer step at the largest fitting micro-batch (0 when nothing fits)."""
        return self.max_batch_size * self.plan.seq_len * self.plan.dp

    def to_dict(self) -> dict:
        return {
            "strategy": self.label,
            "method": str(self.plan.method),
            "variant": self.variant,
            "scheme": str(self.scheme),
            "gpus": self.plan.gpus,
            "tp": self.tp,
            "zero": self.zero,
            "peak_bytes": self.peak_bytes,
            "peak_gib": round(self.peak_bytes / (1 << 30), 3),
            "device_total_bytes": self.device_total_bytes,
            "device_total_gib": round(self.device_total_bytes / (1 << 30), 3),
            "peak_phase": self.estimate.peak_phase,
            "fits": self.fits,
            "verdict": self.verdict,
            "device_total_high_gib": round(self.device_total_high_bytes / (1 << 30), 3),
            "headroom_gib": round(self.headroom_bytes / (1 << 30), 3),
            "max_batch_size": self.max_batch_size,
            "tokens_per_step": self.tokens_per_step,
            "host_node_gib": round(self.estimate.host_node_bytes / (1 << 30), 3),  # offloaded, per node; 0 if none
        }


@dataclass(frozen=True)
class Comparison:
    rows: tuple[Row, ...]
    recommended: Row | None
    reason: str

    def to_frame(self):
        import pandas as pd

        frame = pd.DataFrame([r.to_dict() for r in self.rows])
        frame["recommended"] = [r is self.recommended for r in self.rows]
        return frame


# What `--methods NAME` adds to a comparison: the plan fields each method changes.
METHOD_VARIANTS = {
    "full": {"method": Method.FULL, "quant": "none", "lora_modules_to_save": ""},
    "lora": {"method": Method.LORA, "quant": "none"},
    # QLoRA's usual program: the 4-bit base computes in bf16 (mixed precision is not how bitsandbytes runs it)
    "qlora": {"method": Method.QLORA, "quant": "nf4", "precision": "bf16"},
    # full fine-tuning with the optimizer on the host: torchao's CPUOffloadOptimizer (one GPU) ...
    "offload-optimizer": {"method": Method.FULL, "quant": "none", "offload": Offload.OPTIMIZER},
    # ... and FSDP2's CPUOffloadPolicy (ZeRO-2/3 on 2+ GPUs; its ZeRO-2 row comes with it)
    "offload-params": {"method": Method.FULL, "quant": "none", "offload": Offload.OPTIMIZER_PARAMS, "zero": 3},
    # the plan with one of torchtune's memory savers switched on: "with" beside the plan's own "without"
    "chunked-ce": {"loss": Loss.CHUNKED_CE},
    "optimizer-in-backward": {"optimizer_in_backward": True},
}


def method_label(plan: TrainingPlan) -> str:
    """"" for full fine-tuning; otherwise the method and its memory-relevant settings."""
    if plan.method is Method.LORA:
        return f"LoRA r={plan.lora_rank}"
    if plan.method is Method.QLORA:
        return f"QLoRA {plan.quant} r={plan.lora_rank} ({plan.precision})"
    if plan.method is not Method.FULL:
        return str(plan.method)
    if plan.offload is not Offload.NONE:
        return f"offload {plan.offload}"
    savers = [f"chunked-ce ×{plan.loss_chunks}"] if plan.loss is Loss.CHUNKED_CE else []
    savers += ["optimizer in backward"] if plan.optimizer_in_backward else []
    return ", ".join(savers)


def parse_methods(text: str) -> str:
    """`"qlora, lora"` -> `"lora,qlora"` (known names, sorted, once each); InputError naming `methods` otherwise."""
    names = sorted({n.strip().lower() for n in str(text).split(",") if n.strip()})
    unknown = [n for n in names if n not in METHOD_VARIANTS]
    if unknown:
        raise InputError("methods", f"{', '.join(unknown)} not known; choose from {', '.join(METHOD_VARIANTS)}")
    return ",".join(names)


def method_variants(text: str) -> list[dict]:
    """The plan changes of each method named in `text` (see `parse_methods`)."""
    return [METHOD_VARIANTS[n] for n in parse_methods(text).split(",") if n]


def variant_plans(spec: ModelSpec, plan: TrainingPlan, variants) -> list[TrainingPlan]:
    """The plan with each variant's fields changed: every valid strategy on plan.gpus GPUs when the variant runs
    there (with the plan's strategy, else with DDP: e.g. qlora when the plan is TP), else the single-GPU
    plan. Variants equal to the plan itself, or invalid even on one GPU, are left out."""
    out: list[TrainingPlan] = []
    for changes in variants:
        variant = None
        for where in ({}, {"tp": 1, "zero": 0}, {"gpus": 1, "tp": 1, "zero": 0}):
            try:
                variant = plan.with_(**{**where, **changes})  # the method's own fields (e.g. zero) win
                break
            except InputError:
                continue
        if variant is None or variant == plan:
            continue
        try:
            out += strategies(spec, variant)
        except InputError:
            continue
    return list(dict.fromkeys(out))


def strategies(spec: ModelSpec, plan: TrainingPlan) -> list[TrainingPlan]:
    """Every (TP, ZeRO) of DESIGN.md section 2 that is valid for this model on plan.gpus GPUs."""
    n = plan.gpus
    if n == 1:
        return [plan.with_(tp=1, zero=0)]
    out = []
    for z in range(4):
        try:  # some optimizers run on DDP and ZeRO-1 only (TrainingPlan rejects the rest)
            out.append(plan.with_(tp=1, zero=z))
        except InputError:
            continue
    for tp in range(2, n + 1):
        if n % tp:
            continue
        try:
            candidate = plan.with_(tp=tp, zero=0 if tp == n else 3)
            validate_plan_for_model(spec, candidate)
        except InputError:
            continue
        out.append(candidate)
    return out


def _device_total(peak: int, plan: TrainingPlan) -> int:
    return peak + outside.fragmentation_bytes(peak, plan) + outside.cuda_context_bytes(plan)


def _peak(spec: ModelSpec, plan: TrainingPlan) -> int:
    """`estimate(spec, plan).peak_bytes` of a plan already validated: the largest moment's total."""
    return max(p.total for p in plan_phases(spec, plan))


def max_batch_size(spec: ModelSpec, plan: TrainingPlan, capacity_bytes: int) -> int:
    """Largest micro-batch whose device total fits `capacity_bytes` (0 if even 1 does not), at most the largest
    the plan allows (`MAX_TOKENS // seq_len`)."""
    return _max_batch_size(spec, plan, capacity_bytes)


def _max_batch_size(spec: ModelSpec, plan: TrainingPlan, capacity_bytes: int, phases=None) -> int:
    """`max_batch_size`, given the plan's own phases when they are known (`compare` has its estimate's). Under
    `--pp` the batch is the step's, M microbatches of equal size: the solve runs over the microbatch size (every
    stage's moments are linear in it too) and returns M times it."""
    unit = plan.microbatches if plan.pp > 1 else 1
    limit = MAX_TOKENS // plan.seq_len // unit
    if limit < 2:  # a sequence over half the token bound: one unit is the only batch the plan allows
        return unit * int(estimate(spec, plan.with_(batch_size=unit)).device_total_bytes <= capacity_bytes)
    # units of the batch -> phase totals
    own = phases is not None and not plan.batch_size % unit
    totals = {plan.batch_size // unit: [(p.name, p.total) for p in phases]} if own else {}
    for units in (1, 2):
        if units not in totals:
            at = plan if plan.batch_size == units * unit else plan.with_(batch_size=units * unit)
            totals[units] = [(p.name, p.total) for p in plan_phases(spec, at)]
    one, two = totals[1], totals[2]
    best = limit
    # device total is monotone in the peak: find the largest peak that fits, then the batch for each phase
    fitting_peak = _largest_fitting_peak(capacity_bytes, plan)
    for lo, hi in _paired(one, two):
        slope, base = hi - lo, lo - (hi - lo)
        if slope <= 0:
            continue
        best = min(best, max(0, (fitting_peak - base) // slope))
    if best < 1:
        return 0
    validate_plan_for_model(spec, plan)  # as `estimate` would (the batch size changes nothing it checks)
    while best >= 1 and _device_total(max(t for _, t in totals[best]) if best in totals else
                                      _peak(spec, plan.with_(batch_size=best * unit)), plan) > capacity_bytes:
        best -= 1
    return _replayed_fit(spec, plan, best, unit, capacity_bytes) * unit


def _replayed_fit(spec: ModelSpec, plan: TrainingPlan, best: int, unit: int, capacity_bytes: int) -> int:
    """The largest batch (in units) at most `best` whose estimate's device total fits: where the reserved point
    figure is the allocator model's replay (`reserved.point_replays`), which the solve's flat allowance
    (`_device_total`) can under-state (FSDP1's stream pools about +18 %; the others up to +24 %)."""
    from llmem.components import reserved

    if plan.device is not Device.CUDA or not reserved.point_replays(spec, plan):
        return best
    while best >= 1 and estimate(spec, plan.with_(batch_size=best * unit)).device_total_bytes > capacity_bytes:
        best -= 1
    return best


def _paired(one: list, two: list) -> list[tuple[int, int]]:
    """The moments of batch 1 and batch 2 paired by name and order of occurrence. A walk leaves out a moment whose
    extra is 0 at that batch (gemma-3's in-flight last layer at batch 2), so the lists need not match; a moment
    present at one batch only gives no line, and the exact check that follows the guess still sees it."""
    def keyed(phases):
        seen: dict[str, int] = {}
        out = {}
        for name, total in phases:
            seen[name] = seen.get(name, 0) + 1
            out[(name, seen[name])] = total
        return out

    a, b = keyed(one), keyed(two)
    return [(a[k], b[k]) for k in a if k in b]


def _largest_fitting_peak(capacity_bytes: int, plan: TrainingPlan) -> int:
    """Inverse of `_device_total` (monotone): the largest peak in [0, capacity] whose device total fits, else 0.
    From the closed form's guess, stepped to the exact answer."""
    fraction = outside.FRAGMENTATION_FRACTION if plan.device is Device.CUDA else 0.0
    peak = min(max(int((capacity_bytes - outside.cuda_context_bytes(plan)) / (1 + fraction)), 0), capacity_bytes)
    while peak < capacity_bytes and _device_total(peak + 1, plan) <= capacity_bytes:
        peak += 1
    while peak > 0 and _device_total(peak, plan) > capacity_bytes:
        peak -= 1
    return peak


def compare(spec: ModelSpec, plan: TrainingPlan, capacity_bytes: int, variants=()) -> Comparison:
    """All strategies for plan.gpus GPUs of `capacity_bytes` each, at plan.batch_size, with a recommendation among
    them; then the rows of each variant (a dict of plan fields to change, e.g. `{"method": "lora"}`)."""
    if capacity_bytes <= 0:
        raise InputError("gpu-type", "GPU memory must be positive")
    own = strategies(spec, plan)
    rows = []
    for i, p in enumerate(own + [v for v in variant_plans(spec, plan, variants) if v not in own]):
        est = estimate(spec, p)
        rows.append(Row(p, est, capacity_bytes, _max_batch_size(spec, p, capacity_bytes, est.phases),
                        variant=i >= len(own)))
    rows = tuple(rows)
    fitting = [r for r in rows[:len(own)] if r.fits]
    if not fitting:
        best = min(rows[:len(own)], key=lambda r: r.device_total_bytes)
        return Comparison(rows, None, f"nothing fits at micro-batch {plan.batch_size}: the smallest need is "
                          f"{best.label} at {format_gib(best.device_total_bytes)} per GPU, "
                          f"short by {format_gib(-best.headroom_bytes)}")
    return Comparison(rows, *_recommend(fitting))


def _recommend(fitting: list[Row]) -> tuple[Row, str]:
    """The most tokens per step among the rows that fit at the high end of their device total (ties: less
    communication); only when none does, among those that fit at the low end, said to be risky."""
    safe = [r for r in fitting if r.verdict == FITS]
    pool = safe or fitting
    rec = max(pool, key=lambda r: (r.tokens_per_step, -COMMUNICATION_ORDER.index(r.scheme), -r.tp))
    ties = "; ties go to less communication" if len(pool) > 1 else ""
    reason = (f"{rec.label} fits with {format_gib(rec.headroom_bytes)} to spare and allows micro-batch "
              f"{rec.max_batch_size} ({rec.tokens_per_step:,} tokens per step), the most of the "
              f"{'fitting' if safe else 'low-end fitting'} strategies{ties}")
    if not safe:
        reason += (f" — risky: it fits only at the low end; at the high end it needs "
                   f"{format_gib(rec.device_total_high_bytes)} per GPU ({RISK_FIX})")
    return rec, reason
