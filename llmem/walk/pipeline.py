"""`--pp N`: the moments of each pipeline stage (one per rank), and the worst stage (`pipeline_phases`).

A stage runs the one-GPU program of its own layers once per microbatch, with several microbatches in flight
(`components.pipeline.in_flight`). The moments of one microbatch's backward are the one-GPU walk's
(`walk.single`) of one microbatch with every gradient alive or not (`--grad-accum 2`: micro-steps 1 and 2), less
what the whole model holds there beside them (`_excess`): so the layer tables, the loss and the optimizer step are
the one-GPU walk's, not copied. Each stage adds its own parameters, gradients and optimizer states
(`components.pipeline.stage_spec`), the activations of the other microbatches in flight, and the pipeline's
buffers (`components.pipeline.buffer_bytes`).
"""

from __future__ import annotations

from llmem.components import Category
from llmem.components import logits as lg
from llmem.components import pipeline as pl
from llmem.components import pipeline_lora as pll
from llmem.components.gradients import gradient_bytes, head_gradient_bytes, later_layers_gradient_bytes
from llmem.components.optimizer import optimizer_state_bytes, optimizer_step_temporary_bytes
from llmem.components.parameters import parameter_bytes
from llmem.plan import PpSchedule, TrainingPlan
from llmem.spec import ModelSpec
from llmem.walk import pipeline_fsdp
from llmem.walk.phase import Phase, moment

_LAST, _FIRST, _ALIVE = "backward (last layer", "backward (first layer", "gradients alive"


def _excess(spec: ModelSpec, q: TrainingPlan) -> dict[str, int]:
    """The one-GPU walk of one microbatch (`q`, --grad-accum 2): at each backward moment of a decoder layer and of
    the head, its live total less the parameters, optimizer states and the gradients that exist before that
    microbatch's backward reached there, and less every layer's kept activations and the tensors outside the layers
    (`kept_all`): what the microbatch's own backward adds at that moment. Keyed `mN-last`, `mN-first`, `mN-head`,
    `mN-end` (the embedding's backward, every gradient made; N = micro-step: 1 no gradient yet, 2 all of them)."""
    from llmem.components import activations as act
    from llmem.walk.single import iteration_phases, terms

    q2 = q.with_(grad_accum=2)
    t = terms(spec, q2)
    persistent = parameter_bytes(spec, q2) + optimizer_state_bytes(spec, q2)
    grads, head = gradient_bytes(spec, q2), head_gradient_bytes(spec, q2)
    kept_all = spec.num_layers * pll.kept_per_layer_bytes(spec, q2) + act.outer_saved_bytes(spec, q2) \
        - pll.first_layer_saving_bytes(spec, q2)
    out: dict[str, int] = {}
    for ph in iteration_phases(spec, q2):
        step = 2 if _ALIVE in ph.name or "(micro-step 2)" in ph.name else 1
        # the weight copies autocast made that the layers' and the head's mm saved are a microbatch's own
        # (`components.pipeline.saved_copy_bytes`, in `microbatch_bytes`)
        # in a layer's backward the one-GPU output's logits are alive; a stage's are its own (`head_freed_bytes`)
        if ph.name.startswith(_LAST):
            key, before, held = "last", (grads if step == 2 else head), kept_all + t.base_casts
            held += ph.breakdown[Category.LOGITS]
        elif ph.name.startswith(_FIRST):
            key, before = "first", (grads if step == 2 else head + later_layers_gradient_bytes(spec, q2, 0))
            held = act.outer_saved_bytes(spec, q2) + ph.breakdown[Category.LOGITS]
        elif ph.name.startswith(("loss backward", "lm_head backward", "final norm backward")):
            key, before, held = "head", (grads if step == 2 else 0), kept_all + t.base_casts + t.head_cast
        elif ph.name.startswith("backward end"):  # the embedding's backward: its input gradient (and accumulation)
            key, before, held = "end", grads, ph.breakdown[Category.LOGITS]
        else:
            continue
        k = f"m{step}-{key}"
        out[k] = max(out.get(k, 0), ph.total - persistent - before - held)
    return out


def stage_phases(spec: ModelSpec, plan: TrainingPlan, stage: int) -> list[Phase]:
    """The moments of stage `stage`, each named with it."""
    q = pl.microbatch_plan(plan)
    s = pl.stage_spec(spec, plan, stage)
    first, last = stage == 0, stage == pl.num_stages(plan) - 1
    k, m = pl.in_flight(plan, stage), plan.microbatches
    one = pl.microbatch_bytes(spec, plan, stage)  # one microbatch's activations held on this stage
    later = pl.later_in_flight(plan, stage)
    on = dict(parameters=parameter_bytes(s, q), optimizer=optimizer_state_bytes(s, q),
              standing=pl.standing_bytes(spec, plan, stage), activations=pl.step_input_bytes(spec, plan, stage))
    if plan.zero == 3:  # FSDP2 beside the pipeline: sharded and (kept) unsharded parameters, sharded states
        on.update(pipeline_fsdp.persistent(spec, plan, stage))
    act, grads = on.pop("activations"), gradient_bytes(s, q)
    ex = _excess(spec, q)
    lora_first = pll.stage_first_layer_bytes(spec, q, stage)  # LoRA: a later stage's first layer holds more
    x = pl.hidden_bytes(spec, plan)
    # the output gradient sits in a receive buffer; the last stage's head was freed before its layers' backward
    # (on the last stage less the logits, which `backward_one_chunk` holds until it returns, T:958-1062)
    incoming = pl.head_freed_bytes(spec, plan) - lg.logits_bytes(spec, q) if last else x
    # the previous microbatch's input gradient, still referenced by its send; an output by its forward send
    sent = x * (not first) + pl.held_output_bytes(spec, plan, stage)
    head = head_gradient_bytes(spec, q) if last else 0
    name = f"stage {stage}: "
    phases = _forward_moments(spec, plan, stage, on, grads, sent, act + k * one)
    layers = s.num_layers
    if layers:
        phases.append(moment(name + "first backward, last layer", **on, gradients=head,
                             activations=act + k * one, temporaries=ex["m1-last"] - incoming))
        phases.append(moment(name + "first backward, first layer", **on, gradients=head + _layer_grads(s, q),
                             activations=act + (k - 1) * one + pl.layer_free_bytes(spec, plan, stage),
                             temporaries=ex["m1-first"] + lora_first))
    if m > 1 and layers:
        phases.append(moment(name + "later backward, last layer", **on, gradients=grads,
                             activations=act + later * one, temporaries=ex["m2-last"] - incoming + sent))
        phases.append(moment(name + "later backward, first layer", **on, gradients=grads,
                             activations=act + (later - 1) * one + pl.layer_free_bytes(spec, plan, stage),
                             temporaries=ex["m2-first"] + lora_first + sent))
    if first:  # the embedding's backward, the stage's gradients made (`_excess`'s `mN-end`)
        phases.append(moment(name + "first backward, embedding", **on, gradients=grads,
                             activations=act + (k - 1) * one, temporaries=ex["m1-end"]))
        if m > 1:
            phases.append(moment(name + "later backward, embedding", **on, gradients=grads,
                                 activations=act + (later - 1) * one, temporaries=ex["m2-end"] + sent))
    if last:  # `_excess` left the head's weight copy out (`t.head_cast`); a microbatch's own, in `one`
        phases.append(moment(name + "first backward, loss and lm_head", **on, activations=act + k * one,
                             temporaries=ex["m1-head"] - pl.head_held_bytes(spec, plan)))
        if m > 1:
            phases.append(moment(name + "later backward, loss and lm_head", **on, gradients=grads,
                                 activations=act + later * one,
                                 temporaries=ex["m2-head"] - pl.head_held_bytes(spec, plan) + sent))
    ends = pl.input_gradient_bytes(spec, plan, stage) if plan.pp_schedule is PpSchedule.GPIPE else 0
    if plan.pp_schedule is PpSchedule.GPIPE:
        phases.append(moment(name + "backward end", **on, gradients=grads, activations=act + ends))
    if plan.zero == 3:  # the first forward's all-gathers; `perform_reduce_grad`, then the step on the shards
        return (pipeline_fsdp.first_forward_phases(spec, plan, stage, name, on, act) + phases
                + pipeline_fsdp.reduce_phases(spec, plan, stage, name, on, act + ends, act))
    return phases + [moment(name + "optimizer step", **on, gradients=grads, activations=act,
                            temporaries=optimizer_step_temporary_bytes(s, q))]


def _forward_moments(spec: ModelSpec, plan: TrainingPlan, stage: int, on: dict, grads: int, sent: int,
                     held: int) -> list[Phase]:
    """The forward with its microbatches in flight (`held`), and inside its last layer (`layer_forward_bytes`). 1F1B's
    steady-state forward runs after a backward: its gradients (`grads`), and what that backward's sends hold
    (`sent`: `bwd_sends` until the next backward, the warm-up's `send_work` until the cooldown, S:1062-1147)."""
    name = f"stage {stage}: "
    fwd_grads, fwd_sent = (grads, sent) if pl.forward_after_backward(plan, stage) else (0, 0)
    cache = pl.forward_cache_bytes(spec, plan, stage)
    phases = [moment(name + "forward, microbatches in flight", **on, gradients=fwd_grads, activations=held,
                     temporaries=cache + fwd_sent)]
    inflight = pl.layer_forward_bytes(spec, plan, stage)
    if inflight:
        phases.append(moment(name + "forward, inside the last layer", **on, gradients=fwd_grads,
                             activations=held + inflight, temporaries=cache + fwd_sent))
    return phases


def _layer_grads(s: ModelSpec, q: TrainingPlan) -> int:
    """The stage's decoder layers after its first (made before the first layer's backward)."""
    return later_layers_gradient_bytes(s, q, 0)


def pipeline_phases(spec: ModelSpec, plan: TrainingPlan) -> list[Phase]:
    """Every stage's moments (the looped schedule: every rank's, `walk.interleaved`); the estimate's peak is the
    largest, i.e. the worst stage's."""
    if pl.stages_per_rank(plan) > 1:
        from llmem.walk.interleaved import interleaved_phases

        return interleaved_phases(spec, plan)
    return [ph for stage in range(plan.pp) for ph in stage_phases(spec, plan, stage)]


def stage_peaks(phases: list[Phase] | tuple[Phase, ...], plan: TrainingPlan) -> list[int]:
    """Each rank's peak (its largest moment), from the moments' names: rank i runs stage i, or under the looped
    schedule the stages `walk.interleaved.rank_name` names."""
    from llmem.walk.interleaved import rank_name

    def prefix(r: int) -> str:
        return rank_name(plan, r) if pl.stages_per_rank(plan) > 1 else f"stage {r}: "

    return [max(ph.total for ph in phases if ph.name.startswith(prefix(r))) for r in range(plan.pp)]

