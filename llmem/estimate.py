"""Walk one steady-state iteration (DESIGN.md section 1) and take the largest live total.

Iteration 2 is the steady state: optimizer states exist from the start. Decoder layers are identical, so the walk
(`llmem.walk`: `single.iteration_phases`, `fsdp.fsdp_phases`) evaluates the moments where live memory can peak —
the end of forward, the loss forward and backward, the lm_head's and the final norm's backward, the backward of the
first and last decoder layers, the end of backward, and the optimizer step — each as a breakdown by category that
sums exactly to the moment's total; `estimate` names the largest.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field

from llmem import support_lora_dtype
from llmem.components import Category, act_offload, ds_lora, float8, fused_ce, lora, offload, outside, reserved
from llmem.components.optimizer import paged_state_bytes
from llmem.plan import AllocConf, Device, Engine, GradCkpt, Loss, Scheme, TrainingPlan
from llmem.spec import ModelSpec, program_spec
from llmem.walk.accumulation import accumulation_phases, fsdp_accumulation_phases  # noqa: F401 (re-exported)
from llmem.walk.fsdp import compute_plan, fsdp_phases  # noqa: F401 (re-exported)
from llmem.walk.fsdp_layer import lora_recompute_end  # noqa: F401 (re-exported)
from llmem.walk.phase import Phase  # noqa: F401 (re-exported)
from llmem.walk.replay import walked
from llmem.walk.single import iteration_phases

FITS, RISKY, NO_FIT = "fits", "risky", "no"  # a plan's verdict on a GPU (`Estimate.verdict`)
# What the two ends of the reserved range are (`Estimate.reserved_bytes_range`)
RISK_FIX = ("the ends are a model built in full on the GPU whose freed blocks stay cached, and one built on the meta "
            "device or the CPU, or with torch.cuda.empty_cache() after wrapping (the point figure): how the run "
            "builds decides its end")


@dataclass(frozen=True)
class Estimate:
    """What one rank's steady-state iteration costs. Sizes in bytes; `breakdown` sums to `peak_bytes`."""

    spec: ModelSpec
    plan: TrainingPlan
    peak_phase: str
    breakdown: dict  # Category -> bytes at the peak
    phases: tuple[Phase, ...] = field(repr=False)
    cuda_context_bytes: int = 0
    paged_state_bytes: int = 0  # PagedAdamW8bit on CUDA: states in unified memory, outside the allocator
    host_breakdown: dict = field(default_factory=dict)  # Category -> host bytes per rank (--offload), not in peak
    host_pinned_bytes: int = 0
    expandable_reserved_bytes: int | None = field(default=None, repr=False, compare=False)  # the rules' figure,
    #                       computed once for the allowance (`_fragmentation_bytes`) and read by the range

    @property
    def host_bytes(self) -> int:
        """Host memory one rank holds at its largest (offloaded parameters, gradients, optimizer states, step)."""
        return sum(self.host_breakdown.values())

    @property
    def host_node_bytes(self) -> int:
        """Host memory of one node: every rank on it holds its own shard."""
        return self.host_bytes * offload.ranks_per_node(self.plan)

    @property
    def peak_bytes(self) -> int:
        return sum(self.breakdown.values())

    @property
    def stage_peaks(self) -> list[int]:
        """`--pp`: each rank's peak (rank i runs stage i, or its stages under the looped schedule; `peak_bytes` is
        the worst); else []."""
        if self.plan.pp == 1:
            return []
        from llmem.walk.pipeline import stage_peaks

        return stage_peaks(self.phases, self.plan)

    @property
    def peak_bytes_range(self) -> tuple[int, int]:
        """(lowest, highest) peak over what the user did not say. MoE routing is the one such input, and it moves
        nothing: transformers runs the experts as grouped matmuls over tokens × top_k rows whichever experts the
        tokens pick (tests/components/test_moe_routing.py measures both extremes to the byte), so the range is
        one point for every modelled plan; the verdict uses its high end."""
        return self.peak_bytes, self.peak_bytes

    @functools.cached_property
    def fragmentation_bytes(self) -> int:
        """Reserved minus the peak (`_fragmentation_bytes`), worked out when first asked: a replay of the program's
        requests where `reserved.point_replays`, which `estimate` itself does not need."""
        peak = next(p for p in self.phases if p.name == self.peak_phase)
        return _fragmentation_bytes(self.spec, self.plan, peak, self.expandable_reserved_bytes)

    @property
    def reserved_bytes(self) -> int:
        """Predicted `max_memory_reserved`: the peak plus the caching allocator's rounding, fragmentation and stream
        pools, for the program with nothing of the build cached (`_fragmentation_bytes`)."""
        return self.peak_bytes + self.fragmentation_bytes

    @property
    def device_total_bytes(self) -> int:
        """What `nvidia-smi` shows: reserved memory plus the CUDA context and the paged optimizer states (unified
        memory resident on the GPU) outside the allocator."""
        return self.reserved_bytes + self.cuda_context_bytes + self.paged_state_bytes

    @functools.cached_property
    def reserved_bytes_range(self) -> tuple[int, int]:
        """(low, high) `max_memory_reserved` over the allocator state the user did not say: the figures of two
        programs, `reserved_bytes` (nothing of the build cached: a meta-device or CPU build, or `empty_cache` after
        wrapping) and what the caching allocator's rules reserve for DESIGN.md section 1's program
        (`llmem.components.reserved`: the model built in full on the device, its segments kept cached), under
        `--alloc-conf`; either may be the larger (a cached build segment can serve the step). With expandable
        segments any freed page serves any later request of its stream, so the rules give the peak in 20 MiB pages
        (within 2.1 % of `simulate` on 29 full-size rows) for both. With default segments the plans
        `request_stream.replays` accepts (one GPU, DDP, ZeRO-1, TP, FSDP2, FSDP1 FULL_SHARD) replay the program's
        own requests, each on its stream, through the allocator model for the built program (within 3 % of
        `simulate`) and for the point figure's (`reserved.point_replays`; within −2.9 … +4.7 % of its emptied-cache
        replay, docs/notes/2026-11-28-point-replay-all.md); other plans keep the flat allowance and the category
        high-water (−14 … +19 %, docs/notes/2026-11-27-reserved-agreement.md)."""
        expandable = self.plan.alloc_conf is AllocConf.EXPANDABLE  # --alloc-conf: the rules of that setting
        high = self.expandable_reserved_bytes if expandable else None
        if high is None:
            peak = next(p for p in self.phases if p.name == self.peak_phase)
            high = reserved.reserved_bytes(self.spec, self.plan, self.phases, peak, expandable)
        return min(self.reserved_bytes, high), max(self.reserved_bytes, high)

    @property
    def device_total_bytes_range(self) -> tuple[int, int]:
        """(low, high) device total: `reserved_bytes_range` plus what lies outside the allocator. The verdict uses
        the high end (`verdict`)."""
        outside_bytes = self.cuda_context_bytes + self.paged_state_bytes
        low, high = self.reserved_bytes_range
        return low + outside_bytes, high + outside_bytes

    def verdict(self, capacity_bytes: int) -> str:
        """`FITS` when the high end of the device total fits, `RISKY` when only the low end does, else `NO_FIT`."""
        low, high = self.device_total_bytes_range
        return FITS if high <= capacity_bytes else RISKY if low <= capacity_bytes else NO_FIT

    @property
    def notes(self) -> tuple[str, ...]:
        """Plain-language facts about the plan (e.g. FSDP2 padding small tensors to the rank count)."""
        from llmem.notes import plan_notes

        return plan_notes(self.spec, self.plan)

    @property
    def total_params(self) -> int:
        """Every parameter of the model that runs (LoRA: base plus adapters)."""
        return lora.total_params(self.spec, self.plan)

    @property
    def trainable_params(self) -> int:
        return lora.trainable_params(self.spec, self.plan)

    def to_dict(self) -> dict:
        return {
            "model": self.spec.name,
            "model_type": self.spec.model_type,
            "plan": self.plan.to_dict(),
            "scheme": str(self.plan.scheme),
            "peak_bytes": self.peak_bytes,
            "peak_bytes_range": list(self.peak_bytes_range),
            "peak_phase": self.peak_phase,
            "breakdown": {str(k): v for k, v in self.breakdown.items()},
            "total_params": self.total_params,
            "trainable_params": self.trainable_params,
            "cuda_context_bytes": self.cuda_context_bytes,
            "fragmentation_bytes": self.fragmentation_bytes,
            "paged_state_bytes": self.paged_state_bytes,
            "reserved_bytes": self.reserved_bytes,
            "device_total_bytes": self.device_total_bytes,
            "reserved_bytes_range": list(self.reserved_bytes_range),
            "device_total_bytes_range": list(self.device_total_bytes_range),
            "host_bytes": self.host_bytes,
            "host_breakdown": {str(k): v for k, v in self.host_breakdown.items()},
            "host_pinned_bytes": self.host_pinned_bytes,
            "host_node_bytes": self.host_node_bytes,
            "host_ranks_per_node": offload.ranks_per_node(self.plan),
            "phases": {p.name: p.total for p in self.phases},
            "stage_peaks": self.stage_peaks,  # --pp: per stage (= rank); the worst is peak_bytes
            "worst_stage": self.stage_peaks.index(self.peak_bytes) if self.stage_peaks else None,
            "notes": list(self.notes),
        }


def estimate(spec: ModelSpec, plan: TrainingPlan) -> Estimate:
    """The per-GPU peak of `plan` on `spec` (largest rank), its phase and breakdown."""
    spec = program_spec(spec, plan)
    validate_plan_for_model(spec, plan)
    # the walk's moments: a new batch or sequence length of a layout walked before evaluates its compiled record
    # (`walk.replay`); a walked plan's are kept on the spec (`ModelSpec.memo`): a plan equal to one asked before
    # (the table again after a GPU-type change, an option toggled back) is not walked again
    phases = walked(spec, plan, plan_phases)
    peak = max(phases, key=_TOTAL)
    expandable = reserved.reserved_bytes(spec, plan, phases, peak, True) \
        if plan.alloc_conf is AllocConf.EXPANDABLE and plan.device is Device.CUDA else None
    return Estimate(
        spec=spec,
        plan=plan,
        peak_phase=peak.name,
        breakdown=dict(peak.breakdown),
        phases=phases,
        cuda_context_bytes=outside.cuda_context_bytes(plan),
        paged_state_bytes=paged_state_bytes(spec, plan),
        host_breakdown=_host_breakdown(spec, plan),
        host_pinned_bytes=offload.host_pinned_bytes(spec, plan) + act_offload.host_pinned_bytes(spec, plan),
        expandable_reserved_bytes=expandable,
    )


_TOTAL = operator.attrgetter("total")


def _fragmentation_bytes(spec: ModelSpec, plan: TrainingPlan, peak, expandable: int | None) -> int:
    """Reserved minus the peak. With default segments on CUDA, the allocator model's replay of the program with
    nothing of the build cached where `reserved.point_replays` (the plans the request stream covers), else the flat
    allowance
    (`reserved.point_bytes`). Under `--alloc-conf expandable-segments` on CUDA, the caching allocator's rules
    (`reserved.reserved_bytes`: the peak or the build's bytes in 20 MiB pages, plus FSDP2's stream pools) give it —
    within 2.1 % of `simulate` on 29 full-size rows (docs/notes/2026-11-27-reserved-agreement.md); `expandable`:
    that figure (None: not that setting)."""
    if plan.device is not Device.CUDA:
        return 0
    if expandable is None:
        return reserved.point_bytes(spec, plan, peak) - peak.total
    return max(0, expandable - peak.total)


def _host_breakdown(spec: ModelSpec, plan: TrainingPlan) -> dict:
    """The offloaded bytes by category (`offload.host_breakdown`), with `--activation-offload`'s pinned copies of the
    saved activations (`act_offload.host_bytes`); both at their largest, summed (a bound when both apply)."""
    host = dict(offload.host_breakdown(spec, plan))
    if act_offload.applies(plan):
        host[Category.ACTIVATIONS] = act_offload.host_bytes(spec, plan)
    return host


def plan_phases(spec: ModelSpec, plan: TrainingPlan) -> list[Phase]:
    """The walk of the plan's program: every pipeline stage's moments under `--pp` (`walk.pipeline`), else the one
    rank's (`walk.single.iteration_phases`, which dispatches FSDP2 and FSDP1)."""
    if plan.pp > 1:
        from llmem.walk.pipeline import pipeline_phases

        return pipeline_phases(program_spec(spec, plan), plan)
    if plan.cp > 1:  # the FSDP2 walk of the sequence shard, with the ring's buffers (`walk.context_parallel`)
        from llmem.walk.context_parallel import cp_phases

        return cp_phases(spec, plan, iteration_phases)
    return iteration_phases(spec, plan)


def validate_plan_for_model(spec: ModelSpec, plan: TrainingPlan) -> None:
    """Checks that need both: TP must divide the heads and the MLP width, and the family must have a TP plan. None
    reads the micro-batch or the sequence length, so a plan's layout that passed is remembered on the spec."""
    spec.memo(("validated", plan.layout_key), lambda: _validate_plan_for_model(spec, plan))


def _validate_plan_for_model(spec: ModelSpec, plan: TrainingPlan) -> None:
    from llmem.errors import GAP, REFUSED, InputError
    spec.family  # noqa: B018 - an architecture outside llmem.families is refused here, naming model_type
    lora.validate(spec, plan)
    lora.check_supported(spec, plan)
    ds_lora.check(spec, plan)
    support_lora_dtype.check_model(spec, plan)
    float8.check(spec, plan)
    act_offload.check_model(spec, plan)
    if plan.cp > 1:
        from llmem.components import context_parallel

        context_parallel.check(spec, plan)
    from llmem.components import flat_lora

    flat_lora.check_model(spec, plan)  # FSDP1 NO_SHARD over tied embeddings: the real program stops
    if plan.engine is Engine.FSDP1 and lora.is_lora(plan) and (
            spec.derived is not None or not spec.family.lora_activations):
        raise InputError("engine", f"LoRA under FSDP1 is modelled for the hand-written LoRA tables (llama-like "
                         f"families); {spec.model_type!r}'s are traced (measured 2.4 % low on gpt2): use --engine "
                         "torch", GAP)
    if plan.pp > 1:
        from llmem.components import pipeline

        pipeline.check(spec, plan)
    from llmem.components import returned_probs

    returned_probs.check(spec, plan)
    if plan.grad_ckpt is GradCkpt.SELECTIVE and (spec.is_moe or spec.derived is not None):
        raise InputError("grad-ckpt", "selective checkpointing is modelled for the hand-written dense families (not "
                         f"measured on MoE or traced architectures, {spec.model_type!r}); use --grad-ckpt full", GAP)
    if fused_ce.is_fused(plan) and not spec.family.liger_kernel:
        raise InputError("loss", f"fused-linear-ce is modelled for the families {', '.join(fused_ce.LIGER_LISTED)} "
                         f"(Liger-Kernel patches them); {spec.model_type!r} is not one: use --loss standard", REFUSED)
    if plan.loss is Loss.CHUNKED_CE:
        from llmem.runtime.chunked import check_model

        check_model(spec.model_type, plan.tp)
    if plan.tp == 1:
        return
    if not spec.supports_tp:
        raise InputError("tp", f"{spec.model_type!r} has no tensor-parallel plan (its config's base_model_tp_plan "
                         "is empty), so transformers cannot shard it; use --tp 1 (DDP or ZeRO)", REFUSED)
    if not spec.family.tp_plan or lora.is_lora(plan):  # the model's own plan: layers the derived path cannot take yet
        from llmem.derive.tp import lora_target_refusal
        from llmem.spec import hf_tp_spec

        tp_spec = hf_tp_spec(spec, plan)
        refusal = lora_target_refusal(tp_spec, plan) if lora.is_lora(plan) else None
        if refusal is not None:
            raise refusal
    sizes = (("num_attention_heads", spec.num_heads), ("num_key_value_heads", spec.num_kv_heads))
    if spec.family.tp_plan:  # the Megatron plan splits the MLP evenly; transformers' styles need whole heads only
        sizes += (("intermediate_size", spec.intermediate_size),)
    for name, value in sizes:
        if value % plan.tp:
            raise InputError("tp", f"TP degree {plan.tp} must divide {name} = {value}; "
                             f"choose a divisor of {value}")
    if plan.scheme not in (Scheme.TP, Scheme.TP_ZERO3):
        raise InputError("tp", "internal: TP degree without a TP scheme")
