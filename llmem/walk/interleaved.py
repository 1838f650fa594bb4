"""`--pp-schedule interleaved-1f1b`: the moments of each rank, which runs `--pp-stages-per-rank` stages
(`components.pipeline.rank_stages`), walked action by action in the order torch's `ScheduleInterleaved1F1B` gives
that rank (`rank_order`; torch 2.13.0's torch/distributed/pipelining/schedules.py, S below).

A forward of stage s holds one more microbatch of s (`components.pipeline.microbatch_bytes`); a backward is the
one-GPU walk's backward of one microbatch (`walk.pipeline._excess`: the first of its stage before any of the stage's
gradients exist, the later ones with them), beside the gradients of the rank's stages already backwarded, the
activations of every microbatch in flight on the rank, and what the sends hold: `_PipelineScheduleRuntime` keeps
every send's work in `send_ops` until the step ends (S:2440, S:2469-2472, waited at S:2654-2655), so the output
of each backwarded microbatch (every stage but the last) and each input gradient sent back (every stage but the
first) stay alive until the optimizer step.
"""

from __future__ import annotations

from dataclasses import replace

from llmem.components import logits as lg
from llmem.components import pipeline as pl
from llmem.components import pipeline_lora as pll
from llmem.components.gradients import gradient_bytes, head_gradient_bytes, later_layers_gradient_bytes
from llmem.components.optimizer import optimizer_state_bytes, optimizer_step_temporary_bytes
from llmem.components.parameters import parameter_bytes
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from llmem.walk.phase import Phase, moment


def rank_order(plan: TrainingPlan, rank: int) -> list[tuple[str, int]]:
    """The compute actions of `rank`, ("F" or "B", stage), in order: `_calculate_single_rank_operations`
    (S:2954-3005) and `_get_1f1b_rank_ops` (S:2735-2869) without the idle slots. Warm-up: `_get_warmup_ops`
    (S:2872-2888) forwards, `(V - 1) * microbatches_per_round + 2 * (pp - 1 - rank)` capped at `M * V`; then one
    forward and one backward per op, then the remaining backwards. Forward op i runs local stage
    `(i // per_round) % V`, backward op i local stage `V - 1 - ((i - warmup) // per_round) % V` (S:2981-2993), with
    `per_round = M // max(1, M // pp)` (S:2935-2936). The microbatch of each is the next of that stage."""
    v, m, pp = pl.stages_per_rank(plan), plan.microbatches, plan.pp
    per_round = m // max(1, m // pp)
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)
    ops = m * v

    def fwd(i: int) -> tuple[str, int]:
        return "F", ((i // per_round) % v) * pp + rank

    def bwd(i: int) -> tuple[str, int]:
        return "B", (v - 1 - ((i - warmup) // per_round) % v) * pp + rank

    out = [fwd(i) for i in range(warmup)]
    for i in range(warmup, ops):
        out += [fwd(i), bwd(i)]
    return out + [bwd(i) for i in range(ops, ops + warmup)]


def rank_spec(spec: ModelSpec, plan: TrainingPlan, rank: int) -> ModelSpec:
    """The parameters the rank's optimizer steps, in `ModuleList` order: its stages' (`stage_spec`) one after the
    other, their decoder layers renumbered in that order."""
    def build() -> ModelSpec:
        params, start = [], 0
        for stage in pl.rank_stages(plan, rank):
            s = pl.stage_spec(spec, plan, stage)
            params += [p if p.layer is None else replace(p, layer=p.layer + start) for p in s.params]
            start += s.num_layers
        return replace(spec, num_layers=start, params=tuple(params))

    return spec.memo(("pp-rank", pl.num_stages(plan), rank), build)


def rank_name(plan: TrainingPlan, rank: int) -> str:
    """The moments' prefix of `rank`: its stages."""
    return f"GPU {rank} (stages {', '.join(map(str, pl.rank_stages(plan, rank)))}): "


class _Stage:
    """What one stage of the rank adds: its gradients, a microbatch's held activations, the moments' corrections."""

    def __init__(self, spec: ModelSpec, plan: TrainingPlan, q: TrainingPlan, stage: int) -> None:
        s = pl.stage_spec(spec, plan, stage)
        self.index, self.layers = stage, s.num_layers
        self.last, self.first = stage == pl.num_stages(plan) - 1, stage == 0
        self.grads, self.head = gradient_bytes(s, q), head_gradient_bytes(s, q) if self.last else 0
        self.layer_grads = later_layers_gradient_bytes(s, q, 0) if self.layers else 0
        self.one = pl.microbatch_bytes(spec, plan, stage)
        # LoRA: a later stage's first layer holds more in its backward than the model's layer 0 (`pipeline_lora`)
        self.free = pl.layer_free_bytes(spec, plan, stage) + pll.stage_first_layer_bytes(spec, q, stage)
        x = pl.hidden_bytes(spec, plan)
        # the output gradient sits in a receive buffer; the last stage's head was freed before its layers' backward
        self.incoming = pl.head_freed_bytes(spec, plan) - lg.logits_bytes(spec, q) if self.last else x
        # in the loss's and lm_head's backward the lm_head's saved half weight copy is still alive (`_excess` has
        # none: the one-GPU walk counts it apart)
        self.head_held = pl.head_held_bytes(spec, plan)
        self.cache = pl.forward_cache_bytes(spec, plan, stage)
        self.inflight = pl.layer_forward_bytes(spec, plan, stage)
        self.sent = x * (not self.first) + x * (not self.last)  # held by the send works once backwarded


def rank_phases(spec: ModelSpec, plan: TrainingPlan, rank: int) -> list[Phase]:
    """The moments of `rank`, action by action (`rank_order`)."""
    from llmem.walk.pipeline import _excess

    q = pl.microbatch_plan(plan)
    r = rank_spec(spec, plan, rank)
    stages = {s: _Stage(spec, plan, q, s) for s in pl.rank_stages(plan, rank)}
    on = dict(parameters=parameter_bytes(r, q), optimizer=optimizer_state_bytes(r, q),
              standing=sum(pl.standing_bytes(spec, plan, s) for s in stages))
    act = pl.step_input_bytes(spec, plan, rank)
    ex = _excess(spec, q)
    name = rank_name(plan, rank)
    grads = held = sent = 0  # gradients of the stages backwarded, activations in flight, tensors the sends hold
    done: set[int] = set()
    phases = []
    for kind, index in rank_order(plan, rank):
        st = stages[index]
        label = f"{name}{'forward' if kind == 'F' else 'backward'} of stage {index}"
        if kind == "F":
            held += st.one
            phases.append(moment(label, **on, gradients=grads, activations=act + held, temporaries=st.cache + sent))
            if st.inflight:  # inside its last layer (`layer_forward_bytes`)
                phases.append(moment(label + ", inside the last layer", **on, gradients=grads,
                                     activations=act + held + st.inflight, temporaries=st.cache + sent))
            continue
        first = st.index not in done
        phases += _backward(st, label, on, ex, first, grads, act + held, sent)
        held -= st.one
        sent += st.sent
        if first:
            done.add(st.index)
            grads += st.grads
        # its end: every gradient of the stage made, the microbatch freed; stage 0 runs the embedding's backward
        end = ex["m1-end" if first else "m2-end"] if st.first else 0
        phases.append(moment(label + ", end", **on, gradients=grads, activations=act + held, temporaries=sent + end))
    phases.append(moment(name + "backward end", **on, gradients=grads, activations=act + sent))
    phases.append(moment(name + "optimizer step", **on, gradients=grads, activations=act,
                         temporaries=optimizer_step_temporary_bytes(r, q)))
    return phases


def _backward(st: _Stage, label: str, on: dict, ex: dict, first: bool, grads: int, held: int,
              sent: int) -> list[Phase]:
    """One backward of stage `st` (its first: `first`): the head's moment on the last stage, its last and first
    decoder layers' as `walk.pipeline.stage_phases` has them; `held`: the activations in flight, this one's too."""
    m = "m1" if first else "m2"  # later: `grads` has the stage's own
    out = []
    if st.last:
        out.append(moment(label + ", loss and lm_head", **on, gradients=grads, activations=held,
                          temporaries=ex[f"{m}-head"] - st.head_held + sent))
    if st.layers:
        out.append(moment(label + ", last layer", **on, gradients=grads + st.head * first,
                          activations=held, temporaries=ex[f"{m}-last"] - st.incoming + sent))
        out.append(moment(label + ", first layer", **on,
                          gradients=grads + (st.head + st.layer_grads) * first,
                          activations=held - st.one + st.free, temporaries=ex[f"{m}-first"] + sent))
    return out


def interleaved_phases(spec: ModelSpec, plan: TrainingPlan) -> list[Phase]:
    """Every rank's moments; the estimate's peak is the largest, i.e. the worst rank's."""
    return [ph for rank in range(plan.pp) for ph in rank_phases(spec, plan, rank)]
