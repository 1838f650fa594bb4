"""Activation-checkpointing planner: the least recomputation that fits a memory budget.

Candidates, from the least recomputation to the most: no checkpointing (0 layers recomputed), `--grad-ckpt full
--ckpt-every K` for K = L .. 2 (ceil(L / K) layers recomputed: layers 0, K, 2K, ...), and full checkpointing
(K = 1, every layer). Each candidate is the caller's plan with only `grad_ckpt` / `ckpt_every` changed, estimated
with `llmem.estimate.estimate`; it fits when its `device_total_bytes` (the peak, plus on the cuda profile the
fragmentation allowance and the CUDA context — what the estimate's fits verdict uses) is at most the capacity.
Several K give the same number of recomputed layers; of those the one with the lowest estimated peak represents
that count (ties: the largest K). The chosen candidate is the fitting one with the fewest recomputed layers, so every
candidate that recomputes fewer layers does not fit.

Search: where the backward moments' live bytes never fall (or never rise) from one layer to the next, the device
total is monotone in K among the K of one count (`_group_choice` has the argument), so each count needs one estimate
or a bisection — about 200 estimates for 4,096 layers instead of 4,096; where the trend is mixed every K is estimated.
Either way the answer is the one estimating every K gives (tests/test_ckpt_walk.py).

Recompute cost (compute, not memory) — an approximation in FLOPs, stated per optimizer step of one data-parallel
replica (summed over its tensor-parallel ranks): each checkpointed layer runs its forward once more in backward,

    layer forward FLOPs ≈ 2 × active layer parameters × tokens  +  4 × batch × seq² × (heads × head_dim)

the first term the matmuls (a multiply-add is 2 FLOPs per weight per token: Kaplan et al. 2020, "Scaling Laws for
Neural Language Models", C_forward ≈ 2N), the second the attention scores q·kᵀ and probabilities·v over the full
seq × seq square (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", 4·b·s²·h per layer; causal kernels may skip about half of it). For mixture-of-experts layers the
active parameters count top_k of the E experts. Norms, activations functions, RoPE and softmax are not counted.
Tokens = micro-batch × seq_len × grad_accum micro-steps.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from llmem.errors import InputError
from llmem.estimate import Estimate, estimate, validate_plan_for_model
from llmem.plan import GradCkpt, TrainingPlan
from llmem.spec import ModelSpec
from llmem.units import format_gib


def layer_forward_flops(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Approximate forward FLOPs of one decoder layer for one micro-batch (module docstring: formula, sources)."""
    tokens = plan.batch_size * plan.seq_len
    params = 0
    for p in spec.layer_params(0):
        if ".experts." in p.name and spec.num_experts:
            params += p.numel * spec.experts_per_token // spec.num_experts  # top_k of E experts per token
        else:
            params += p.numel
    attention = 4 * plan.batch_size * plan.seq_len ** 2 * spec.num_heads * spec.head_dim
    return 2 * params * tokens + attention


def model_forward_flops(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Approximate forward FLOPs of the whole model for one micro-batch: every layer plus the lm_head matmul."""
    tokens = plan.batch_size * plan.seq_len
    return spec.num_layers * layer_forward_flops(spec, plan) + 2 * spec.vocab_size * spec.hidden_size * tokens


@dataclass(frozen=True)
class CkptOption:
    """One candidate: its plan, estimate and recompute cost."""

    plan: TrainingPlan
    estimate: Estimate
    recomputed_layers: int
    extra_forward_flops: int  # per optimizer step (all micro-steps), one data-parallel replica
    capacity_bytes: int

    @property
    def label(self) -> str:
        if self.plan.grad_ckpt is GradCkpt.NONE:
            return "none"
        if self.plan.ckpt_every == 1:
            return "full"
        return f"every {self.plan.ckpt_every} layers"

    @property
    def options(self) -> str:
        """The command-line options that select this candidate."""
        if self.plan.grad_ckpt is GradCkpt.NONE:
            return "--grad-ckpt none"
        return "--grad-ckpt full" + (f" --ckpt-every {self.plan.ckpt_every}" if self.plan.ckpt_every > 1 else "")

    @property
    def fits(self) -> bool:
        """Whether the device total fits; a peak that alone (with what lies outside the allocator) exceeds the
        capacity does not fit whatever the reserved point figure (at least the peak: `reserved.point_bytes`), so a
        plan over it is answered without the allocator model's replay (a 4,096-layer stream: ~1 M requests)."""
        est = self.estimate
        if est.peak_bytes + est.cuda_context_bytes + est.paged_state_bytes > self.capacity_bytes:
            return False
        return est.device_total_bytes <= self.capacity_bytes

    def to_dict(self) -> dict:
        return {"label": self.label, "options": self.options, "grad_ckpt": str(self.plan.grad_ckpt),
                "ckpt_every": self.plan.ckpt_every, "recomputed_layers": self.recomputed_layers,
                "peak_bytes": self.estimate.peak_bytes, "peak_phase": self.estimate.peak_phase,
                "device_total_bytes": self.estimate.device_total_bytes, "fits": self.fits,
                "extra_forward_flops": self.extra_forward_flops}


@dataclass(frozen=True)
class CkptPlan:
    spec: ModelSpec
    capacity_bytes: int
    options: tuple[CkptOption, ...]  # fewest recomputed layers first
    chosen: CkptOption | None
    step_forward_flops: int  # the model's forward FLOPs per optimizer step, for scale

    @property
    def reason(self) -> str:
        if self.chosen is None:
            least = min(reversed(self.options), key=lambda o: o.estimate.device_total_bytes)  # ties: most ckpt
            return (f"nothing fits in {format_gib(self.capacity_bytes)}: even {least.label} checkpointing needs "
                    f"{format_gib(least.estimate.device_total_bytes)} ({least.options}); reduce the micro-batch or "
                    "sequence length, shard (ZeRO/TP), or use a larger GPU")
        c = self.chosen
        if c.recomputed_layers == 0:
            return f"no checkpointing needed: {format_gib(c.estimate.device_total_bytes)} fits"
        share = c.extra_forward_flops / self.step_forward_flops if self.step_forward_flops else 0.0
        return (f"{c.label} checkpointing ({c.options}) fits with {format_gib(c.estimate.device_total_bytes)}: "
                f"recomputes {c.recomputed_layers} of {self.spec.num_layers} layers, about "
                f"{c.extra_forward_flops:.3g} extra forward FLOPs per step ({share:.0%} of one forward)")

    def to_dict(self) -> dict:
        return {"capacity_bytes": self.capacity_bytes, "chosen": self.chosen.to_dict() if self.chosen else None,
                "reason": self.reason, "step_forward_flops": self.step_forward_flops,
                "options": [o.to_dict() for o in self.options]}


def candidate_plans(spec: ModelSpec, plan: TrainingPlan) -> list[TrainingPlan]:
    """Every checkpointing choice valid for `plan` (none, every K-th layer, full), other fields unchanged."""
    plans = [plan.with_(grad_ckpt=GradCkpt.NONE, ckpt_every=1)]
    for k in range(spec.num_layers, 0, -1):
        p = _every(spec, plan, k)
        if p is not None:
            plans.append(p)
    return plans


def _every(spec: ModelSpec, plan: TrainingPlan, k: int) -> TrainingPlan | None:
    from llmem.components import returned_probs

    try:
        p = plan.with_(grad_ckpt=GradCkpt.FULL, ckpt_every=k)
        returned_probs.check(spec, p)  # falcon / BLOOM eager: K > 1 is a gap
        return p
    except InputError:  # e.g. an int8 base: partial checkpointing is not modelled
        return None


def plan_checkpointing(spec: ModelSpec, plan: TrainingPlan, capacity_bytes: int) -> CkptPlan:
    """The checkpointing choice with the fewest recomputed layers whose estimate fits `capacity_bytes` per GPU.
    `plan`'s own grad_ckpt / ckpt_every are ignored (they are what is chosen). Of the K that recompute the same
    number of layers, the one with the lowest device total represents it (ties: the largest K), found as
    `_group_choice` says — the same answer as estimating every K."""
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
        raise InputError("gpu-type", f"capacity must be a positive number of bytes, got {capacity_bytes!r}")
    validate_plan_for_model(spec, plan)
    per_layer = layer_forward_flops(spec, plan) * plan.grad_accum
    layers = spec.num_layers
    estimates: dict[int, Estimate] = {}

    def total(k: int) -> int:
        if k not in estimates:
            estimates[k] = estimate(spec, _every(spec, plan, k))
        return estimates[k].device_total_bytes

    none = plan.with_(grad_ckpt=GradCkpt.NONE, ckpt_every=1)
    options = [CkptOption(none, estimate(spec, none), 0, 0, capacity_bytes)]
    trend = _layer_trend(spec, plan, total, estimates) if _every(spec, plan, 2) is not None else None
    for n in range(1, layers + 1):  # n layers recomputed: K in [ceil(L / n), floor((L - 1) / (n - 1))]
        lo, hi = -(-layers // n), (layers - 1) // (n - 1) if n > 1 else layers
        if lo > hi or _every(spec, plan, hi) is None:
            continue
        k = _group_choice(layers, n, lo, hi, total, trend if lo > 1 else None)
        options.append(CkptOption(_every(spec, plan, k), estimates[k], n, n * per_layer, capacity_bytes))
    chosen = next((o for o in options if o.fits), None)
    return CkptPlan(spec, capacity_bytes, tuple(options), chosen,
                    model_forward_flops(spec, plan) * plan.grad_accum)


_LAYER = re.compile(r"\(layer \d+(?=[),])")


def _layer_trend(spec: ModelSpec, plan: TrainingPlan, total, estimates: dict) -> str | None:
    """How the live bytes of a layer's backward moments change from one layer to the next at a fixed number of
    checkpointed layers below it: "falling" (never up: the layer's gradients outweigh what it keeps), "rising"
    (never down), or None when the moments disagree, so that every K is estimated. Read off K = L, whose layers
    1 .. L-1 form one run without checkpointed layers: each moment of layer L-2 against the same moment of layer 1.
    The walk's terms are linear in the layer index there (`activations.backward_layers`), with the same slope for
    the moments only checkpointed layers have (they hold the same kept layers and later gradients), except at the
    first layer (FSDP2: no prefetch; LoRA: a no-grad input), which every K has alike, and the last (FSDP2: no
    retained reduce-scatter input). "falling" also needs the last layer's step to be at most the slope (its moments
    not above the line through the others), since `_group_choice` may compare it with a layer below it. A derived
    architecture's layers are of kinds (`llmem.derive.kinds`; at least layer 0's backward is one of its own), so
    its moments are not linear in the layer index: None."""
    layers = spec.num_layers
    if layers < 4 or spec.derived is not None:
        return None
    total(layers)
    phases = {p.name: p.total for p in estimates[layers].phases}
    slopes, last_steps = [], []
    for name, first in phases.items():
        match = _LAYER.search(name)
        if match is None or match.group() != "(layer 1":
            continue
        inner = phases.get(_LAYER.sub(f"(layer {layers - 2}", name, count=1))
        last = phases.get(_LAYER.sub(f"(layer {layers - 1}", name, count=1))
        if inner is None or last is None:
            return None
        slopes.append(inner - first)  # (layers - 3) times the slope
        last_steps.append((last - inner) * (layers - 3) - (inner - first))  # (layers - 3) times the excess
    if slopes and all(s <= 0 for s in slopes) and all(e <= 0 for e in last_steps):
        return "falling"
    if slopes and all(s >= 0 for s in slopes):
        return "rising"
    return None


def _group_choice(layers: int, n: int, lo: int, hi: int, total, trend: str | None) -> int:
    """Of K = lo .. hi (all recomputing n layers: layers 0, K, .., (n-1)K), the K with the lowest device total,
    ties to the largest K. A K with (n-1)K >= L-2 checkpoints one of the last two layers (where the walk has its
    edge) and is estimated on its own. The others have the same forward moments (they depend on how many layers
    are checkpointed in all and below the last layer), and a layer's backward moments depend on K only through how
    many checkpointed layers lie below it and whether it is one. Map layer jK + d of one K to layer jK' + d of
    another K' — the same count below, the same kind:
      falling: each layer of the largest such K has one at or below it in any smaller K with the same count and
        kind (for d >= K: layer (j+1)K - 1), with moments at least as large; so that K is the least: one estimate.
      rising: for K < K' each layer of K maps at or above itself in K' (past layer L-2: to layer L-2, or L-1 to
        itself), so the total does not decrease in K: the least is lo's, and the largest K sharing it is found by a
        galloping bisection.
    Otherwise every K is estimated (largest first, as the planner always did)."""
    top = min(hi, (layers - 3) // (n - 1)) if n > 1 else hi  # the largest K with (n-1)K < L-2
    if lo == hi or trend is None or top < lo:
        best = hi
        total(best)
        for k in range(hi - 1, lo - 1, -1):
            if total(k) < total(best):
                best = k
        return best
    if trend == "falling":
        a = top
        total(a)
    else:
        least, a, b, step = total(lo), lo, top, 1  # total(a) == least; every K > b has a larger total
        if total(top) == least:  # the whole group shares it (the peak is a moment every K has alike)
            a = top
        while a < b:  # galloping bisection: one probe more when the least is lo's alone
            probe = min(a + step, b)
            if total(probe) == least:
                a, step = probe, 2 * step
            else:
                b, step = probe - 1, 1
    best = a
    for k in range(top + 1, hi + 1):  # at most two: (n-1)K in {L-2, L-1}
        if total(k) <= total(best):
            best = k
    return best
