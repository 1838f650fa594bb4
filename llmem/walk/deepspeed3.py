"""The walk of DeepSpeed ZeRO-3 (`--engine deepspeed --zero 3`, `DeepSpeedZeroOptimizer_Stage3`): the one-device
walk's compute moments of the module DeepSpeed runs (bf16 or fp32 weights, no autocast) with DeepSpeed's own
tensors in place of the one-device parameters, gradients and states (`llmem.components.zero3_ds`), the reduces of
the gradient bucket in backward, and the step, in the steady state (the second iteration, whose coordinator
follows the trace the first one recorded).

Parameters: the rank's partitions and master are always there; the persistent parameters are whole outside the
step; the others are gathered as their module first runs and, at the default stage3_max_reuse_distance (1e9
elements), kept until their module's backward is done (`__params_to_release`, partitioned_param_coordinator.py:549:
the trace uses each again in backward). So every non-persistent parameter is gathered at the end of forward,
and in layer k's backward those of the later layers, the final norm and an untied lm_head are released. The input
embeddings' module gets no backward hook (its input needs no gradient) and stays gathered until the step's
`_partition_all_parameters` (stage3.py:2419).

Gradients: each hook copies its gradient into the bucket and frees it (stage3.py:1377); a full bucket is reduced
(:1367) through a concatenation of its gradients (`z3.reduce_temporary_bytes`) and each rank's reduced part copied
into the persistent partition-gradient buffer.
"""

from __future__ import annotations

from llmem.components import Category
from llmem.components import zero3_ds as z3
from llmem.components import zero_ds as z
from llmem.components.gradients import bucket_view_pending_bytes
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from llmem.walk.deepspeed import _layer_of, compute_plan
from llmem.walk.phase import Phase, moment


def _released_before(spec: ModelSpec, layer: int) -> set[int]:
    """The tensors (indices of `ordered_numels`) whose module's backward ended before layer `layer`'s began."""
    return {i for i, key in enumerate(z.backward_keys(spec)) if key > layer and key >= 0}


def _parameters(spec: ModelSpec, plan: TrainingPlan, released: set[int]) -> int:
    """The rank's partitions, the persistent parameters and the gathered ones not released."""
    alive = [i for i in range(len(z.ordered_numels(spec))) if i not in released]
    return z3.lp_bytes(spec, plan) + z3.persistent_param_bytes(spec, plan) + z3.gathered_bytes(spec, plan, alive)


def _fixed_gradients(spec: ModelSpec, plan: TrainingPlan) -> int:
    return z3.grad_partition_bytes(spec, plan) + z3.bucket_bytes(plan)


def _moment_layer(name: str, spec: ModelSpec) -> int | None:
    """The decoder layer of a one-device moment, `num_layers` for the lm_head's backward, -1 at the end of
    backward, None in forward."""
    if name.startswith(("lm_head backward", "final norm backward")):  # (the final norm's: after the lm_head's)
        return spec.num_layers
    if name.startswith("backward end"):
        return -1
    return _layer_of(name, spec.num_layers)


def _compute_moments(spec: ModelSpec, plan: TrainingPlan) -> list[Phase]:
    """The one-device forward and backward moments with ZeRO-3's parameters, master, states and gradients. A
    gradient lives on its own only until its hook copies it into the bucket (stage3.py:1390), as under
    `--optimizer-in-backward`, whose one-device walk counts just those (the one being made, a tied lm_head's
    waiting for the embedding's): that walk's gradients, without its in-backward steps, beside the persistent
    partition gradients and bucket. Under `--grad-accum K` each micro-step's hooks add their partitions into that
    buffer in place (`__partition_grads`, stage3.py:1714-1720: copy at micro-step 0, `add_` after), so every
    micro-step is the one-micro-step program."""
    from llmem.walk.single import iteration_phases

    single = iteration_phases(spec, compute_plan(plan).with_(grad_accum=1, optimizer_in_backward=True))
    optimizer = z3.master_bytes(spec, plan) + z3.state_bytes(spec, plan)
    fixed, out = _fixed_gradients(spec, plan), []
    for ph in single:
        if "step" in ph.name:
            continue
        b = dict(ph.breakdown)
        layer = _moment_layer(ph.name, spec)
        b[Category.PARAMETERS] = _parameters(spec, plan, set() if layer is None else _released_before(spec, layer))
        b[Category.OPTIMIZER] = optimizer
        b[Category.GRADIENTS] += fixed
        out.append(Phase(ph.name, b))
    return out


def _reduce_moments(spec: ModelSpec, plan: TrainingPlan, moments: list[Phase]) -> list[Phase]:
    """Each bucket's reduce at the hook of the gradient that overflows it and the last bucket's in the epilogue
    (at the end of backward). In a layer: the moment that starts its backward (every saved activation of the
    layer held) with, of its gradients, only the persistent ones, a tied lm_head's waiting for the embedding's and
    the one whose hook runs (the transient gradients there belong to the MLP's backward, after the hook)."""
    keys, numels, b = z.backward_keys(spec), z.ordered_numels(spec), z.module_bytes(plan)
    pending = bucket_view_pending_bytes(spec, compute_plan(plan))
    starts = {}
    for ph in moments:
        layer = _moment_layer(ph.name, spec)
        if layer is not None and layer not in starts:
            starts[layer] = ph
    order, out = z3.buckets(spec, plan), []
    for k, tensors in enumerate(order):
        nxt = order[k + 1][0] if k + 1 < len(order) else None
        layer = keys[nxt] if nxt is not None else -1
        # a hook after the lm_head's backward (the final norm's) runs once the logits' gradient is gone: as at the
        # start of the last layer's backward
        br = dict((starts.get(min(layer, spec.num_layers - 1)) or starts[-1]).breakdown)
        if nxt is not None:
            br[Category.GRADIENTS] = (_fixed_gradients(spec, plan) + pending * (layer >= 0) + numels[nxt] * b
                                      + z3.uncopied_bytes(spec, plan, tensors))
        br[Category.TEMPORARIES] += z3.reduce_temporary_bytes(spec, plan, tensors)
        out.append(Phase(f"ZeRO-3 reduce (bucket {k + 1})", br))
    return out


def _step_moments(spec: ModelSpec, plan: TrainingPlan, held: dict) -> list[Phase]:
    """`step` (stage3.py:2414): every parameter partitioned (`_partition_all_parameters`), the flat partition
    gradient (:2211), the client's step on the fp32 partition, then the persistent parameters gathered again
    (`_post_step` :2381)."""
    base = {"parameters": z3.lp_bytes(spec, plan), "optimizer": z3.master_bytes(spec, plan) + z3.state_bytes(
        spec, plan), **held}
    fixed = _fixed_gradients(spec, plan)
    return [
        moment("optimizer step (flat partition gradient)", **base,
               gradients=fixed + z3.step_grad_bytes(spec, plan)),
        moment("optimizer step", **base, gradients=fixed + z3.master_bytes(spec, plan),
               temporaries=z3.step_temporary_bytes(spec, plan)),
    ]


def zero3_phases(spec: ModelSpec, plan: TrainingPlan) -> list[Phase]:
    """DeepSpeed ZeRO-3: the candidate peak moments of one steady-state iteration (every rank alike: each
    parameter is split evenly)."""
    from llmem.walk.single import iteration_phases

    step = next(ph for ph in iteration_phases(spec, compute_plan(plan)) if ph.name == "optimizer step")
    held = {"logits": step.breakdown[Category.LOGITS], "activations": step.breakdown[Category.ACTIVATIONS]}
    moments = _compute_moments(spec, plan)
    return moments + _reduce_moments(spec, plan, moments) + _step_moments(spec, plan, held)
