"""The walk of DeepSpeed ZeRO-0/1/2 (`--engine deepspeed`, `DeepSpeedZeroOptimizer`): the one-device walk's compute
moments of the module DeepSpeed runs (bf16 or fp32 weights, no autocast), with DeepSpeed's own parameters, master
partition, states and gradient buffers in place of the one-device ones (`llmem.components.zero_ds`), then the
reductions, the step and the all-gather of the partitions, on the rank where they peak.

Gradients in backward: ZeRO-1 keeps every `.grad` whole until `engine.backward` ends (its hooks only open the
bucket: `process_gradients` reduces under `partition_gradients or overlap_comm`, stage_1_and_2.py:1617), then
`reduce_gradients` (:827) moves them through the bucket in registration order; ZeRO-2 copies each gradient into
the bucket as its hook runs (:1118) and frees its own storage, so backward holds the bucket and, once a bucket with
a tensor of this rank's partition was reduced, the partition gradients. Under overlap_comm ZeRO-1 reduces in its
hooks as ZeRO-2 does (`z.reduces_in_backward`) and the bucket is doubled. ZeRO-0 builds no ZeRO optimizer: the
one-device program with the engine's all-reduce after backward (`_zero0_phases`).

`--grad-accum K` (`gradient_accumulation_steps`, the boundary set before each backward as accelerate does): ZeRO-0
and ZeRO-1 reduce only at the boundary (engine.py `allreduce_gradients` :2428), so their `.grad`s accumulate whole
in place as on one device (the one-device walk's micro-step moments), ZeRO-1's bucket alive from the first hook to
the boundary's reduce; ZeRO-2 reduces every micro-step and keeps the partition gradients of the earlier ones
(`all_grad_tensors`, `independent_gradient_partition_epilogue` :880, :899) beside the next one's (`_later_micro_steps`).
"""

from __future__ import annotations

import re

from llmem.components import Category, ds_lora
from llmem.components import zero3_ds as z3
from llmem.components import zero_ds as z
from llmem.components.parameters import buffer_bytes
from llmem.options import DS_PERSISTENCE_THRESHOLD, DS_PREFETCH_BUCKET
from llmem.plan import Engine, Method, Precision, TrainingPlan
from llmem.spec import ModelSpec
from llmem.walk import deepspeed_hooks as hooks
from llmem.walk.phase import Phase, moment

DEFAULT_BUCKET = 500_000_000
MICRO = "(micro-step"  # the one-device walk's moments of a later micro-step (`walk.accumulation`)


def compute_plan(plan: TrainingPlan) -> TrainingPlan:
    """The one-device plan of the module DeepSpeed computes with: bf16 weights and gradients without autocast
    under bf16 (the engine casts the module), fp32 otherwise."""
    precision = Precision.BF16 if plan.precision is Precision.BF16_MIXED else Precision.FP32
    return plan.with_(gpus=1, zero=0, engine=Engine.TORCH, precision=precision, ds_reduce_bucket=DEFAULT_BUCKET,
                      ds_overlap_comm=False, ds_prefetch_bucket=DS_PREFETCH_BUCKET,
                      ds_persistence_threshold=DS_PERSISTENCE_THRESHOLD)


def _persistent(spec: ModelSpec, plan: TrainingPlan) -> dict:
    """The module's flat parameters (under LoRA `spec` is the adapters' view, `ds_lora`: the frozen base beside
    them), the fp32 master partition and the client optimizer's states over it."""
    frozen = ds_lora.frozen_numel(spec.base, plan) if isinstance(spec, ds_lora.TrainableView) else 0
    return {Category.PARAMETERS: z.flat_param_bytes(spec, plan) + frozen * z.module_bytes(plan)
            + z.buffer_bytes(spec, plan),
            Category.OPTIMIZER: z.master_bytes(spec, plan) + z.state_bytes(spec, plan)}


def _partition_grads(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The largest rank's partition gradients (`copy_grads_in_partition`), bytes."""
    return max(z.partition_grad_numel(spec, plan, r) for r in z.candidate_ranks(spec, plan)) * z.module_bytes(plan)


def _layer_of(name: str, layers: int) -> int | None:
    """The decoder layer a one-device backward moment is in (`single.backward_edges` names), None for the others."""
    match = re.match(r"backward \((last layer|first layer|layer (\d+))", name)
    if match is None:
        return None
    return layers - 1 if match[1] == "last layer" else 0 if match[1] == "first layer" else int(match[2])


def _compute_moments(spec: ModelSpec, plan: TrainingPlan, single: list[Phase], in_backward: bool,
                     boundary: bool = False) -> list[Phase]:
    """The one-device forward and backward moments with DeepSpeed's persistent bytes and its gradients. ZeRO-1
    holds its bucket, opened at the first gradient hook (an untied lm_head's, inside its backward; else once the
    lm_head's backward returned), beside the whole gradients; where the hooks reduce (`in_backward`: ZeRO-2,
    overlap_comm) `single` is the walk of gradients freed at their hooks and `deepspeed_hooks` adds what the hooks
    hold by then, and at ZeRO-1's `boundary` micro-step the accumulated gradients their hooks have not moved yet."""
    persistent, bucket = _persistent(spec, plan), z.bucket_bytes(plan)
    untied = bool(z.untied_head_numel(spec))
    out = []
    for ph in single:
        if ph.name == "optimizer step" or "step in backward" in ph.name:
            continue
        b = dict(ph.breakdown)
        b.update(persistent)
        name = ph.name
        if in_backward:
            done = hooks.hooks_done(spec, plan, ph.name)
            held = hooks.largest_held(spec, plan, done)
            if boundary or hooks.bucket_open(ph.name):  # (at the boundary: open since micro-step 1's first hook)
                held = max(held, bucket)
            if boundary:  # the .grads accumulated whole until their hooks
                held += hooks.unhooked_bytes(spec, plan, done + hooks.bucket_open(ph.name))
                name = f"{ph.name} {MICRO} {plan.grad_accum}, the boundary)"
            b[Category.GRADIENTS] += held
        elif (ph.name.startswith("backward") or MICRO in ph.name
              or (untied and ph.name.startswith("lm_head backward"))
              or (ph.name == "final norm backward" and (untied or plan.method is Method.FULL))):
            # (the final norm's: the bucket opened at the lm_head's hook, or at the norm weight's, whose
            # AccumulateGrad runs before the norm's input gradient is made)
            b[Category.GRADIENTS] += bucket  # (micro-step 2+: the bucket opened in micro-step 1, not yet released)
        out.append(Phase(name, b))
    return out


def _hook_reduces(spec: ModelSpec, plan: TrainingPlan, single: list[Phase], boundary: bool = False) -> list[Phase]:
    """Each reduce the hooks run in backward (ZeRO-2, overlap_comm): at the hook of the gradient that overflows the
    bucket (`deepspeed_hooks.hook_state`), the bucket's flatten (`zero_ds.flatten_numel`) beside what the hooks held
    before, then the partition gradients it allocates; at ZeRO-1's `boundary` micro-step beside the accumulated
    gradients of the later hooks."""
    persistent, b = _persistent(spec, plan), z.module_bytes(plan)
    moments = {ph.name: ph for ph in single}
    buckets, keys, order = hooks.hook_buckets(spec, plan), z.backward_keys(spec), z3.backward_order(spec)
    out, cache = [], {}
    for k, pos in enumerate(hooks.trigger_positions(spec, plan)):
        inner = 0 <= keys[order[pos]] < spec.num_layers
        state = hooks.hook_state(spec, plan, moments, pos, cache) if inner else hooks.outer_hook_state(
            spec, moments, pos)
        state.update(persistent)
        state[Category.TEMPORARIES] = 0
        grads = state[Category.GRADIENTS] + (hooks.unhooked_bytes(spec, plan, pos + 1) if boundary else 0)
        flat = dict(state, **{Category.GRADIENTS: grads + hooks.largest_held(spec, plan, pos),
                              Category.COMMUNICATION: state[Category.COMMUNICATION]
                              + z.flatten_numel(spec, plan, buckets[k]) * b})
        after = dict(state, **{Category.GRADIENTS: grads + hooks.largest_held(spec, plan, pos + 1)})
        out += [Phase(f"ZeRO-2 reduce in backward (bucket {k + 1})", flat),
                Phase(f"ZeRO-2 reduce in backward (bucket {k + 1}, partition gradients)", after)]
    return out


def _zero1_reduce(spec: ModelSpec, plan: TrainingPlan, base: dict, rank: int) -> list[Phase]:
    """`reduce_gradients` (:827) on `rank`, in registration order: each bucket's gradients copied into it (their own
    storage freed), its flatten beside the gradients not yet moved, then the partition gradients (:1534) once a
    tensor of the partition was reduced. A tensor larger than the bucket is reduced in its own gradient (:1116,
    `extra_large_param_to_reduce`), which stays until the step unless the partition copies it, and flattened a
    group of rank slices at a time (`zero_ds.flatten_numel`)."""
    b, numels, owners = z.module_bytes(plan), z.ordered_numels(spec), z.owner_ranks(spec, plan)
    alive, allocated, bucket = sum(numels) * b, False, z.bucket_bytes(plan)
    own = z.partition_grad_numel(spec, plan, rank) * b
    phases = []
    for k, tensors in enumerate(z.buckets(spec, plan, reverse=False)):
        e = sum(numels[i] for i in tensors) * b
        extra = z.extra_large(spec, plan, tensors)
        alive -= 0 if extra else e
        phases.append(moment(f"ZeRO-1 reduce (bucket {k + 1}, rank {rank})", **base,
                             gradients=bucket + alive + (own if allocated else 0),
                             communication=z.flatten_numel(spec, plan, tensors) * b))
        if any(rank in owners[i] for i in tensors):  # allocated, then the tensor copied in (its own one freed)
            allocated = True
            phases.append(moment(f"ZeRO-1 reduce (bucket {k + 1}, rank {rank}, partition gradients)", **base,
                                 gradients=bucket + alive + own))
            alive -= e if extra else 0
    return phases


def _zero2_epilogue(spec: ModelSpec, plan: TrainingPlan, base: dict, rank: int) -> list[Phase]:
    """The epilogue's reduce of the last bucket (`independent_gradient_partition_epilogue`, :880) on `rank` (a
    tensor larger than the bucket: in its own gradient, beside its flatten)."""
    b, numels, owners = z.module_bytes(plan), z.ordered_numels(spec), z.owner_ranks(spec, plan)
    order = hooks.hook_buckets(spec, plan)
    before = any(rank in owners[i] for tensors in order[:-1] for i in tensors)
    own = z.partition_grad_numel(spec, plan, rank) * b
    e = sum(numels[i] for i in order[-1]) * b
    extra = e if z.extra_large(spec, plan, order[-1]) else 0
    held = z.bucket_bytes(plan) + (own if before else 0) + extra
    flat = z.flatten_numel(spec, plan, order[-1]) * b
    return [moment(f"ZeRO-2 epilogue reduce (rank {rank})", **base, gradients=held, communication=flat),
            moment(f"ZeRO-2 epilogue reduce (rank {rank}, partition gradients)", **base,
                   gradients=z.bucket_bytes(plan) + own + (extra if any(rank in owners[i] for i in order[-1]) else 0))]


def _later_micro_steps(spec: ModelSpec, plan: TrainingPlan, phases: list[Phase]) -> list[Phase]:
    """ZeRO-2 under `--grad-accum K`: a later micro-step's forward, backward and epilogue moments are the first's
    with the earlier partition gradients beside them. The epilogue (:880) keeps them as `all_grad_tensors` (views of
    that micro-step's `grads_in_partition`, :899) when it releases the buffer (`_release_ipg_buffers`, :794); the
    next micro-step's first reduce allocates a new one (:1534), which its epilogue adds into them (`add_`, :905) and
    frees; the boundary's step reads them (:907) as it does after one micro-step."""
    rank = re.compile(r"\(rank (\d+)")
    out = []
    for ph in phases:
        match = rank.search(ph.name)
        own = (z.partition_grad_numel(spec, plan, int(match[1])) * z.module_bytes(plan) if match
               else _partition_grads(spec, plan))
        b = dict(ph.breakdown)
        b[Category.GRADIENTS] = b.get(Category.GRADIENTS, 0) + own
        out.append(Phase(f"{ph.name} {MICRO} {plan.grad_accum})", b))
    return out


def _step_moments(spec: ModelSpec, plan: TrainingPlan, base: dict) -> list[Phase]:
    """`step` (:2113): the flat partition gradient beside the partition gradients, the optimizer's step on the fp32
    partition, the all-gather of the new partitions (runtime/utils.py:1013)."""
    s4 = z.partition_numel(spec, plan) * 4
    return [
        moment("optimizer step (flat partition gradient)", **base,
               gradients=_partition_grads(spec, plan) + z.step_grad_bytes(spec, plan)),
        moment("optimizer step", **base, gradients=s4, temporaries=z.step_temporary_bytes(spec, plan)),
        moment("all-gather of the updated partitions", **base, communication=z.gather_output_bytes(spec, plan)),
    ]


def _zero0_phases(spec: ModelSpec, plan: TrainingPlan, single: list[Phase]) -> list[Phase]:
    """ZeRO-0: no ZeRO optimizer (engine.py:1583, :1590). In fp32 the client optimizer steps the module itself (the
    one-device program); under bf16 `FP16_UnfusedOptimizer` (fp16/unfused_optimizer.py) holds an fp32 clone of each
    parameter of the client's groups (:76) under the client's states and, in `step`, makes every such parameter's
    fp32 gradient (:219) beside the bf16 ones before the client steps (:224). After backward the engine all-reduces
    the whole gradients through flattened buckets (`z.allreduce_flatten_numels`), freed after each copy back.
    LoRA (`spec` the adapters' view; `single` the walk of the model with bf16 adapters, `ds_lora.walk_spec`): the
    client's groups are the adapters."""
    from llmem.walk.single import iteration_phases

    b, bf16 = z.module_bytes(plan), plan.precision is Precision.BF16_MIXED
    model = spec.base if isinstance(spec, ds_lora.TrainableView) else spec  # (PEFT's fp32 adapters)
    fp32 = iteration_phases(model, compute_plan(plan).with_(precision=Precision.FP32)) if bf16 else single
    fp32_step = next(ph.breakdown for ph in fp32 if ph.name == "optimizer step")
    # the fp32 clone of every trainable parameter (the fp32 walk's parameters less the model's fp32 buffers)
    clones = fp32_step[Category.PARAMETERS] - buffer_bytes(model, plan.with_(precision=Precision.FP32))
    if isinstance(spec, ds_lora.TrainableView):
        clones = sum(z.ordered_numels(spec)) * 4
    master = clones + fp32_step[Category.OPTIMIZER] if bf16 else None
    out = []
    for ph in single:
        br = dict(ph.breakdown)
        if master is not None:
            br[Category.OPTIMIZER] = master
        if ph.name == "backward end":
            out.append(Phase("all-reduce of the gradients (largest bucket)", {
                **br, Category.TEMPORARIES: 0, Category.COMMUNICATION: max(z.allreduce_flatten_numels(spec)) * b}))
        if ph.name == "optimizer step" and bf16:
            br[Category.GRADIENTS] += clones  # the fp32 gradients, one per master
            br[Category.TEMPORARIES] = fp32_step[Category.TEMPORARIES]
        out.append(Phase(ph.name, br))
    return out


def deepspeed_phases(spec: ModelSpec, plan: TrainingPlan) -> list[Phase]:
    """DeepSpeed ZeRO-0/1/2: the candidate peak moments of one steady-state iteration on the largest rank."""
    from llmem.walk.single import iteration_phases

    if plan.zero == 3:
        from llmem.walk.deepspeed3 import zero3_phases

        return zero3_phases(spec, plan)
    # the walks read the model (bf16 LoRA: its half adapters), ZeRO its trainables
    walk_spec, spec = ds_lora.walk_spec(spec, plan), ds_lora.trainable_spec(spec, plan)
    if plan.zero == 0:
        return _zero0_phases(spec, plan, iteration_phases(walk_spec, compute_plan(plan)))
    later = plan.grad_accum > 1 and z.reduces_in_backward(plan)  # ZeRO-2: every micro-step reduces
    boundary = later and plan.zero == 1  # ZeRO-1 under overlap_comm: only the boundary's hooks reduce (:1622)
    single = iteration_phases(walk_spec, compute_plan(plan).with_(grad_accum=1) if later and not boundary
                              else compute_plan(plan))
    step = next(ph for ph in single if ph.name == "optimizer step")
    held = {"logits": step.breakdown[Category.LOGITS], "activations": step.breakdown[Category.ACTIVATIONS]}
    persistent = _persistent(spec, plan)
    base = {"parameters": persistent[Category.PARAMETERS], "optimizer": persistent[Category.OPTIMIZER], **held}
    if z.reduces_in_backward(plan):  # gradients freed at their hooks (`deepspeed_hooks`)
        freed = hooks.freed_moments(walk_spec, plan)
        phases = (_compute_moments(spec, plan, freed, True, boundary)
                  + _hook_reduces(spec, plan, freed, boundary))
        if boundary:  # the micro-steps before: ZeRO-1's whole gradients beside the bucket (the last one's: above)
            phases += _compute_moments(spec, plan, [ph for ph in single if MICRO not in ph.name or (
                plan.grad_accum > 2 and "backward" in ph.name)], False)
    else:
        phases = _compute_moments(spec, plan, single, False)
    reduce = _zero2_epilogue if z.reduces_in_backward(plan) else _zero1_reduce
    for rank in z.candidate_ranks(spec, plan):
        phases += reduce(spec, plan, base, rank)
    return (phases + (_later_micro_steps(spec, plan, phases) if later and not boundary else [])
            + _step_moments(spec, plan, base))
