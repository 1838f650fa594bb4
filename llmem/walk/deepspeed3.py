"""The walk of DeepSpeed ZeRO-3 (`--engine deepspeed --zero 3`, `DeepSpeedZeroOptimizer_Stage3`): the one-device
walk's compute moments of the module DeepSpeed runs (bf16 or fp32 weights, no autocast) with DeepSpeed's own
tensors in place of the one-device parameters, gradients and states (`llmem.components.zero3_ds`), the reduces of
the gradient bucket in backward, and the step, in the steady state (the second iteration, whose coordinator
follows the trace the first one recorded).

Parameters: the rank's partitions and master are always there; the persistent parameters are whole outside the
step; the others are gathered as their module first runs and, at the default stage3_max_reuse_distance (1e9
elements), kept until their module's backward is done (`__params_to_release`, partitioned_param_coordinator.py:574-604:
the trace uses each again in backward). So every non-persistent parameter is gathered at the end of forward,
and in layer k's backward those of the later layers, the final norm and an untied lm_head are released; at a
reduce, so are those of layer k's modules whose own backward ended (`_released_at_hooks`; the compute moments keep
layer k whole, an upper bound). The input
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
from llmem.plan import Method, TrainingPlan
from llmem.spec import ModelSpec
from llmem.walk.deepspeed import _layer_of, compute_plan
from llmem.walk.phase import Phase, moment


def _released_before(spec: ModelSpec, layer: int) -> set[int]:
    """The tensors (indices of `ordered_numels`) whose module's backward ended before layer `layer`'s began."""
    return {i for i, key in enumerate(z.backward_keys(spec)) if key > layer and key >= 0}


def _released_at_hooks(spec: ModelSpec, plan: TrainingPlan) -> dict[int, int]:
    """Per tensor (index of `ordered_numels`), the gathered bytes released before its hook runs: those of the
    modules whose backward ended before it. Each module is released once the gradient of its input is made
    (`PostBackwardFunctionModule.backward`, parameter_offload.py:454-457, `post_sub_module_backward_function` :528,
    `release_sub_module`): after its weights' hooks and before the next module's (measured, llama 4 ranks:
    down_proj's gathered weight freed between its hook and up_proj's). So: every later layer's (`_released_before`)
    and, in the tensor's own layer, the other modules whose hooks came first (not its own module's: a bias whose
    hook ran first). One pass over the hooks' order."""
    from llmem.walk.deepspeed_hooks import _param_names

    keys, names, numels = z.backward_keys(spec), _param_names(spec), z.ordered_numels(spec)
    b, module = z.module_bytes(plan), [name.rsplit(".", 1)[0] for name in names]
    gathered = [0 if z3.persists(n, plan) or not z3.gathers_copy(plan) else z3.aligned(n, plan) * b for n in numels]
    out, before, group = {}, 0, []
    for i in z3.backward_order(spec):
        if group and keys[group[0]] != keys[i]:
            before, group = before + sum(gathered[j] for j in group) * (keys[group[0]] >= 0), []
        out[i] = before + sum(gathered[j] for j in group if module[j] != module[i])
        group.append(i)
    return out


def _parameters(spec: ModelSpec, plan: TrainingPlan, released: set[int]) -> int:
    """The rank's partitions, the persistent parameters, the gathered ones not released and the buffers."""
    alive = [i for i in range(len(z.ordered_numels(spec))) if i not in released]
    return (z3.lp_bytes(spec, plan) + z3.persistent_param_bytes(spec, plan) + z3.gathered_bytes(spec, plan, alive)
            + z.buffer_bytes(spec, plan))


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


def _compute_moments(spec: ModelSpec, plan: TrainingPlan, single: list[Phase]) -> list[Phase]:
    """The one-device forward and backward moments with ZeRO-3's parameters, master, states and gradients. A
    gradient lives on its own only until its hook copies it into the bucket (stage3.py:1390), as under
    `--optimizer-in-backward`, whose one-device walk counts just those (the one being made, a tied lm_head's
    waiting for the embedding's): that walk's gradients, without its in-backward steps, beside the persistent
    partition gradients and bucket. Under `--grad-accum K` each micro-step's hooks add their partitions into that
    buffer in place (`__partition_grads`, stage3.py:1714-1720: copy at micro-step 0, `add_` after), so every
    micro-step is the one-micro-step program."""
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


def _reduce_moments(spec: ModelSpec, plan: TrainingPlan, moments: list[Phase], single: list[Phase]) -> list[Phase]:
    """Each bucket's reduce at the hook of the gradient that overflows it and the last bucket's in the epilogue
    (at the end of backward), the triggering gradient alive, a bucket's tensor larger than the bucket still in its
    own gradient (`z3.uncopied_bytes`), in a decoder layer the parameters of the modules whose backward ended
    before the hook released (`_released_at_hooks`). At a layer's MLP hooks from its last MLP Linear's on
    (`_mlp_hooks`): the one-device state at that hook (`deepspeed_hooks.hook_state`, as ZeRO-2's reduces, from
    `single`, the moments under `--optimizer-in-backward`; measured, llama 4 ranks: exact to 161 B at down_proj's
    and up_proj's hooks, 44 KB above at gate_proj's). At its other hooks (norms, attention): the moment that starts
    the layer's backward (every saved activation of the layer held) with, of its gradients, only the persistent
    ones, a tied lm_head's waiting for the embedding's and the one whose hook runs (an upper bound: measured 88-137
    KB above at those hooks). Outside the layers: the next layer's start, or the end of backward."""
    from llmem.walk import deepspeed_hooks as hooks

    keys, numels, b = z.backward_keys(spec), z.ordered_numels(spec), z.module_bytes(plan)
    pending = bucket_view_pending_bytes(spec, compute_plan(plan))
    starts, named, cache, position = {}, {ph.name: ph for ph in single}, {}, _positions(spec)
    everything, released, mlp = _parameters(spec, plan, set()), _released_at_hooks(spec, plan), _mlp_hooks(spec, plan)
    for ph in moments:
        layer = _moment_layer(ph.name, spec)
        if layer is not None and layer not in starts:
            starts[layer] = ph
    order, out = z3.buckets(spec, plan), []
    for k, tensors in enumerate(order):
        nxt = order[k + 1][0] if k + 1 < len(order) else None
        layer = keys[nxt] if nxt is not None else -1
        if nxt in mlp:
            br = hooks.hook_state(spec, plan, named, position[nxt], cache)
            br[Category.OPTIMIZER] = z3.master_bytes(spec, plan) + z3.state_bytes(spec, plan)
            br[Category.GRADIENTS] += _fixed_gradients(spec, plan) + z3.uncopied_bytes(spec, plan, tensors)
        else:
            # a hook after the lm_head's backward (the final norm's) runs once the logits' gradient is gone: as at
            # the start of the last layer's backward
            br = dict((starts.get(min(layer, spec.num_layers - 1)) or starts[-1]).breakdown)
            if nxt is not None:
                br[Category.GRADIENTS] = (_fixed_gradients(spec, plan) + pending * (layer >= 0) + numels[nxt] * b
                                          + z3.uncopied_bytes(spec, plan, tensors))
        if 0 <= layer < spec.num_layers:  # the modules whose backward ended before this hook: released
            br[Category.PARAMETERS] = everything - released[nxt]
        br[Category.TEMPORARIES] += z3.reduce_temporary_bytes(spec, plan, tensors)
        out.append(Phase(f"ZeRO-3 reduce (bucket {k + 1})", br))
    return out


def _mlp_hooks(spec: ModelSpec, plan: TrainingPlan) -> set[int]:
    """The tensors whose hook is one of a decoder layer's MLP weights from its last MLP Linear's on (a gated MLP's
    down, up and gate projections), where the dense tables give the state at the hook
    (`deepspeed_hooks.hook_state`); none without those tables."""
    from llmem.walk import deepspeed_hooks as hooks

    if not hooks._dense(spec, plan):
        return set()
    keys, names, order, out = z.backward_keys(spec), hooks._param_names(spec), z3.backward_order(spec), set()
    for layer in range(spec.num_layers):
        _, first, end = hooks.layer_positions(spec, plan, layer)
        out |= {order[p] for p in range(first, end) if keys[order[p]] == layer and ".mlp." in names[order[p]]}
    return out


def _positions(spec: ModelSpec) -> dict[int, int]:
    """Each tensor's position in the hooks' order (`zero3_ds.backward_order`)."""
    return {i: p for p, i in enumerate(z3.backward_order(spec))}


def _step_moments(spec: ModelSpec, plan: TrainingPlan, held: dict) -> list[Phase]:
    """`step` (stage3.py:2414): every parameter partitioned (`_partition_all_parameters`), the flat partition
    gradient (:2211), the client's step on the fp32 partition, then the persistent parameters gathered again
    (`_post_step` :2381); the buffers stay."""
    base = {"parameters": z3.lp_bytes(spec, plan) + z.buffer_bytes(spec, plan),
            "optimizer": z3.master_bytes(spec, plan) + z3.state_bytes(spec, plan), **held}
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

    if plan.method is not Method.FULL:
        from llmem.walk.deepspeed3_lora import zero3_lora_phases

        return zero3_lora_phases(spec, plan)
    step = next(ph for ph in iteration_phases(spec, compute_plan(plan)) if ph.name == "optimizer step")
    held = {"logits": step.breakdown[Category.LOGITS], "activations": step.breakdown[Category.ACTIVATIONS]}
    single = iteration_phases(spec, compute_plan(plan).with_(grad_accum=1, optimizer_in_backward=True))
    moments = _compute_moments(spec, plan, single)
    return moments + _reduce_moments(spec, plan, moments, single) + _step_moments(spec, plan, held)
