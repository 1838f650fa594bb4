"""DeepSpeed ZeRO-2 (and ZeRO-1 under overlap_comm) in backward: each gradient hook (deepspeed 0.19.0
`runtime/zero/stage_1_and_2.py` `create_gradient_handling_hooks` :1046, a post-accumulate hook) copies its gradient
into the bucket and points the `.grad` at the copy (`reduce_independent_p_g_buckets_and_remove_grads` :1118-1120,
`grad_reduc.data = new_grad_tensor.data...`): the gradient's own storage is freed at its hook, as under
`--optimizer-in-backward`, whose one-device walk counts exactly the gradients in flight. Beside those: the bucket
from the first hook (`setup_buckets` :2317), the rank's partition gradients from the first reduce holding one of its
tensors (`copy_grads_in_partition` :1534), and a tensor larger than the bucket in its own gradient from its hook
until the next hook reduces it (:1116, :1555; under ZeRO-1 kept after that unless the rank's partition copies it,
:1609).

Hooks run in backward's order (`zero3_ds.backward_order`); a reduce runs at the start of the hook whose gradient
would overflow the bucket (:1091), that gradient alive. A layer's one-device moments sit among its hooks: the MLP
moment (the product's backward) after the last MLP Linear's hook (its AccumulateGrad is ready with the product's
input and runs first: the autograd engine's ready queue takes the highest sequence number), the weight-gradient,
recompute and post-norm moments before it, the attention's moments after all of the layer's hooks (partition
gradients a q/k/v hook allocates counted early, never late).

A reduce's own moment is the state at its hook (`_hook_state`). At the last MLP Linear's: the one-device
weight-gradient moment with the Linear's saved input released (`weight_gradient.cast_released_bytes`), exact. At a
later hook of the layer the activation's and product's saved inputs are released (2 i, i = tokens x intermediate x
b), the product's input gradient (i) is replaced by the activation's (i), and the hook's Linear adds its input
gradient (h = tokens x hidden x b) and its weight's in place of the first's: S_first - 2 i + h + (W_t - W_first)+,
exact at a gated MLP's up_proj hook (measured), an upper bound at the later ones (the MLP's saved tensors gone). A
hook before the Linear's other than its bias, or a layer without the dense tables (LoRA, MoE, traced families): the
layer's MLP moment bounds it. Under LoRA the MLP moment follows the last MLP Linear's lora_B and lora_A hooks
(`ds_lora.last_mlp_adapter`), their gradients already in the bucket (`ds_lora.without_mlp_adapter_gradients`).
A layer without moments of its own: the next later layer's, which holds more.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from itertools import accumulate

from llmem.components import Category, ds_lora
from llmem.components import weight_gradient as wgrad
from llmem.components import zero3_ds as z3
from llmem.components import zero_ds as z
from llmem.plan import Method, TrainingPlan
from llmem.spec import ModelSpec
from llmem.walk.phase import Phase

PRE_HOOK = ("MLP weight gradient", "step in backward")  # a layer's moments before its last MLP Linear's hook
LAYER_START = ("recompute", "post-feedforward norm")  # before any of the layer's hooks
HEAD_HOOK = "lm_head hook (the bucket opened)"
MLP_MOMENT = re.compile(r"backward \((last layer|first layer|layer (\d+))(, checkpointed)?\)")


class _Table:
    """The hooks' order and what each count of hooks done holds, computed once per (spec, plan) (`table`)."""

    def __init__(self, spec, plan: TrainingPlan) -> None:
        self.order, self.keys, self.numels = z3.backward_order(spec), z.backward_keys(spec), z.ordered_numels(spec)
        self.names = _param_names(spec)
        self.buckets = z.fill_buckets(self.numels, self.order, plan.ds_reduce_bucket)
        self.triggers = list(accumulate(len(t) for t in self.buckets[:-1]))
        self.position = {i: p for p, i in enumerate(self.order)}
        self.spans: dict[int, tuple[int, int, int]] = {}  # `layer_positions`, filled as asked
        self.layers: dict[int, list[int]] = {}
        for p, i in enumerate(self.order):
            self.layers.setdefault(self.keys[i], []).append(p)
        b = z.module_bytes(plan)
        self.suffix = [0] * (len(self.order) + 1)  # bytes of the tensors at positions >= done
        for p in range(len(self.order) - 1, -1, -1):
            self.suffix[p] = self.suffix[p + 1] + self.numels[self.order[p]] * b
        ranks, self.owners = z.candidate_ranks(spec, plan), z.owner_ranks(spec, plan)
        self.extra = [z.extra_large(spec, plan, tensors) for tensors in self.buckets]
        self.first_bucket: dict[int, int] = {}  # rank -> the first bucket holding one of its tensors
        for k, tensors in enumerate(self.buckets):
            for i in tensors:
                for r in self.owners[i]:
                    self.first_bucket.setdefault(r, k)
        self.held = [max(_held(spec, plan, self, done, r) for r in ranks) for done in range(len(self.order) + 1)]


def table(spec, plan: TrainingPlan) -> _Table:
    """`_Table` for (spec, plan), kept on the spec (a `ds_lora` view keeps its own) per layout: it reads no
    micro-batch or sequence length, so a layout's symbolic walk (`walk.replay`) finds its concrete walk's."""
    return spec.memo(("deepspeed hooks", plan.layout_key), lambda: _Table(spec, plan), per_plan=True)


def hook_buckets(spec: ModelSpec, plan: TrainingPlan) -> list[tuple[int, ...]]:
    """The tensors (indices of `ordered_numels`) of each reduce, filled in the hooks' order (:1091)."""
    return table(spec, plan).buckets


def trigger_positions(spec: ModelSpec, plan: TrainingPlan) -> list[int]:
    """Per bucket but the last (the epilogue's), the position in the hooks' order of the hook that reduces it."""
    return table(spec, plan).triggers


def _param_names(spec: ModelSpec) -> list[str]:
    """The names of `ordered_numels`' tensors."""
    outer = spec.outer_params
    return ([p.name for p in outer if z.EMBEDDING.search(p.name)]
            + [p.name for k in range(spec.num_layers) for p in spec.layer_params(k)]
            + [p.name for p in outer if not z.EMBEDDING.search(p.name)])


def _dense(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """The dense MLP tables `weight_gradient` reads (full fine-tuning)."""
    return plan.method is Method.FULL and wgrad.applies(spec, plan)


def layer_positions(spec: ModelSpec, plan: TrainingPlan, layer: int) -> tuple[int, int, int]:
    """(layer `layer`'s first hook, its last MLP Linear's weight's hook (the first where it has no dense table),
    one past its last hook): positions in the hooks' order (kept in the table)."""
    t = table(spec, plan)
    if layer not in t.spans:
        t.spans[layer] = _layer_span(spec, plan, t, layer)
    return t.spans[layer]


def _layer_span(spec: ModelSpec, plan: TrainingPlan, t: _Table, layer: int) -> tuple[int, int, int]:
    positions = t.layers[layer]
    first = positions[0]
    if plan.method is not Method.FULL:  # LoRA: the MLP moment after the last MLP Linear's adapters' hooks
        mine = [p for p in positions if ds_lora.last_mlp_adapter(t.names[t.order[p]], spec.base, layer)]
        return positions[0], (mine[-1] if mine else positions[0] - 1), positions[-1] + 1
    if _dense(spec, plan):
        suffix = wgrad.last_mlp_weight_name(spec).split(".0.", 1)[-1]
        first = next((p for p in positions if t.names[t.order[p]].endswith(f".{layer}.{suffix}")), first)
    return positions[0], first, positions[-1] + 1


def moment_layer(name: str, layers: int) -> int | None:
    match = re.match(r"backward \((last layer|first layer|layer (\d+))", name)
    if match is None:
        return None
    return layers - 1 if match[1] == "last layer" else 0 if match[1] == "first layer" else int(match[2])


def hooks_done(spec: ModelSpec, plan: TrainingPlan, name: str) -> int:
    """How many hooks (in the hooks' order) ran before the one-device moment `name`."""
    layer = moment_layer(name, spec.num_layers)
    if layer is None:
        if name == "final norm backward":  # after the final norm's hook: every hook before the last layer's
            return len(table(spec, plan).layers.get(spec.num_layers, ()))
        if name.startswith("backward end"):
            return len(z.ordered_numels(spec)) - len(table(spec, plan).layers.get(-1, ()))
        return 0
    start, first, end = layer_positions(spec, plan, layer)
    if any(label in name for label in LAYER_START):
        return start
    if any(label in name for label in PRE_HOOK):
        return first
    return first + 1 if MLP_MOMENT.fullmatch(name.split(" (micro-step")[0]) else end


def _held(spec: ModelSpec, plan: TrainingPlan, t: _Table, done: int, rank: int) -> int:
    """Rank `rank`'s gradient bytes beside those in flight once `done` hooks ran: the bucket (from the first hook),
    its partition gradients (from the first reduce holding one of its tensors), a tensor larger than the bucket not
    yet reduced (ZeRO-1: also each one reduced and not copied into the rank's partition)."""
    if done == 0:
        return 0
    b, owners = z.module_bytes(plan), t.owners
    reduced = bisect_left(t.triggers, done)  # the buckets whose reduce ran (at a hook before `done`)
    held = z.bucket_bytes(plan)
    if t.first_bucket.get(rank, len(t.buckets)) < reduced:
        held += z.partition_grad_numel(spec, plan, rank) * b
    if reduced < len(t.buckets):
        pending = t.buckets[reduced]
        if t.extra[reduced] and t.position[pending[0]] < done:
            held += t.numels[pending[0]] * b
    if plan.zero == 1:
        held += sum(t.numels[t.buckets[k][0]] * b for k in range(reduced)
                    if t.extra[k] and rank not in owners[t.buckets[k][0]])
    return held


def bucket_open(name: str) -> bool:
    """A moment with the bucket open though no hook finished: the first hook's own (an untied lm_head's)."""
    return name == HEAD_HOOK


def largest_held(spec: ModelSpec, plan: TrainingPlan, done: int) -> int:
    """`_held` on the rank where it is largest."""
    return table(spec, plan).held[done]


def _layer_moments(spec: ModelSpec, moments: dict[str, Phase], layer: int, cache: dict) -> tuple:
    """(the MLP moment, the weight-gradient moment or None) of the evaluated layer at or after `layer` (a later
    layer holds more), found once per layer (`cache`)."""
    if layer not in cache:
        if "layers" not in cache:  # each moment's layer, once per walk
            cache["layers"] = {nm: moment_layer(nm, spec.num_layers) for nm in moments}
        layers = cache["layers"]
        evaluated = sorted({k for k in layers.values() if k is not None})
        at = next((k for k in evaluated if k >= layer), evaluated[-1])
        mine = {nm: ph for nm, ph in moments.items() if layers[nm] == at}
        cache[layer] = (next(ph for nm, ph in mine.items() if MLP_MOMENT.fullmatch(nm)),
                        next((ph for nm, ph in mine.items() if nm.endswith(", MLP weight gradient)")), None))
    return cache[layer]


def hook_state(spec: ModelSpec, plan: TrainingPlan, moments: dict[str, Phase], pos: int,
               cache: dict | None = None) -> dict:
    """The one-device breakdown (gradients in flight only) at the hook at position `pos` of the hooks' order, in a
    decoder layer (`moments`: the one-device moments under `--optimizer-in-backward`, by name; `cache`: a dict kept
    across the calls of one walk)."""
    from llmem.walk.deepspeed import compute_plan

    t = table(spec, plan)
    order, numels, names = t.order, t.numels, t.names
    layer = t.keys[order[pos]]
    cache = {} if cache is None else cache
    mlp, made = _layer_moments(spec, moments, layer, cache)
    _, first, _ = layer_positions(spec, plan, layer)
    first_name = names[order[first]]
    bias = pos < first and names[order[pos]] == first_name[: -len("weight")] + "bias"
    if made is None or pos < first and not bias:
        return dict(mlp.breakdown)
    if "terms" not in cache:  # the compute plan's terms, once per walk
        cplan = compute_plan(plan)
        cache["terms"] = (wgrad.cast_released_bytes(spec, cplan), wgrad.output_gradient_bytes(spec, cplan),
                          wgrad.terms(spec, cplan))
    released, output_gradient, (_, inter, residual) = cache["terms"]
    b = z.module_bytes(plan)
    state = dict(made.breakdown)
    state[Category.ACTIVATIONS] -= released
    state[Category.GRADIENTS] -= output_gradient
    if bias:  # the Linear's bias gradient, made with its weight's: both in flight
        state[Category.GRADIENTS] += numels[order[pos]] * b
    elif pos > first:
        state[Category.GRADIENTS] += residual - 2 * inter + max(numels[order[pos]] - numels[order[first]], 0) * b
    return state


def outer_hook_state(spec: ModelSpec, moments: dict[str, Phase], pos: int) -> dict:
    """The one-device breakdown at a hook outside the layers: the lm_head's backward moment (the final norm's hook
    comes after it, the logits' gradient released: an upper bound), the end of backward (the embeddings')."""
    embedding = z.backward_keys(spec)[z3.backward_order(spec)[pos]] < 0
    key = "backward end" if embedding else "lm_head backward"
    return dict(next(ph for nm, ph in moments.items() if nm.startswith(key)).breakdown)


def final_norm_moment(spec: ModelSpec, plan: TrainingPlan, moments: dict[str, Phase]) -> list[Phase]:
    """A llama-like final RMSNorm's backward, after its weight's hook (the weight's `MulBackward0` ran and released
    its normalized input; the lm_head's input is released): at `pow_backward` its fp32 temporaries
    (`norm_backward.final_norm_backward_bytes`) beside the norm's fp32 input and rsqrt and the start of the last
    layer's backward held. With the gradients freed at their hooks it can top the MLP's moment (measured: llama
    bf16, seq 256, 2 ranks)."""
    from llmem.components import activations as act
    from llmem.components import norm_backward as norm_bwd
    from llmem.walk.deepspeed import compute_plan

    cplan = compute_plan(plan)
    saved = act.final_norm_saved(spec, cplan)
    mlp = _last_layer_mlp(spec, moments)
    if plan.method is not Method.FULL or mlp is None or not any(s.name == "final norm.rsqrt" for s in saved):
        return []
    kept = sum(s.bytes for s in saved if s.name != "final norm.normalized" and not s.name.startswith("lm_head"))
    b = dict(mlp.breakdown)
    b[Category.ACTIVATIONS] += kept
    b[Category.GRADIENTS] = 0
    b[Category.TEMPORARIES] = norm_bwd.final_norm_backward_bytes(spec, cplan)
    return [Phase("final norm backward", b)]


def _last_layer_mlp(spec: ModelSpec, moments: dict[str, Phase]) -> Phase | None:
    last = ("backward (last layer)", f"backward (layer {spec.num_layers - 1})")
    return next((ph for nm, ph in moments.items() if nm in last), None)


def head_hook_moment(spec: ModelSpec, plan: TrainingPlan, moments: dict[str, Phase]) -> list[Phase]:
    """An untied lm_head's hook, the first (:1046): it opens the bucket (`setup_buckets` :2317) once the lm_head's
    `MmBackward0` returned and released the logits' gradient (the held logits as at the layers' moments), its weight
    gradient in flight (measured: mistral fp32, 2 ranks, to 92 B). Before it no bucket: the lm_head's backward is
    the one-device moment."""
    head = next((ph for nm, ph in moments.items() if nm == "lm_head backward"), None)
    mlp = _last_layer_mlp(spec, moments)
    if plan.method is not Method.FULL or not z.untied_head_numel(spec) or head is None or mlp is None:
        return []
    b = dict(head.breakdown)
    b[Category.LOGITS] = mlp.breakdown[Category.LOGITS]
    return [Phase(HEAD_HOOK, b)]  # (the bucket: `bucket_open`)


def freed_moments(spec: ModelSpec, plan: TrainingPlan) -> list[Phase]:
    """The one-device moments of one micro-step with each gradient freed at its hook (`--optimizer-in-backward`),
    with the untied lm_head's hook and the final norm's backward."""
    from llmem.walk.deepspeed import compute_plan
    from llmem.walk.single import iteration_phases

    freed = iteration_phases(spec, compute_plan(plan).with_(grad_accum=1, optimizer_in_backward=True))
    if plan.method is not Method.FULL:  # LoRA: the last MLP Linear's adapter gradients are in the bucket by then
        freed = ds_lora.without_mlp_adapter_gradients(spec, compute_plan(plan), freed, MLP_MOMENT)
    named = {ph.name: ph for ph in freed}
    return freed + final_norm_moment(spec, plan, named) + head_hook_moment(spec, plan, named)


def unhooked_bytes(spec: ModelSpec, plan: TrainingPlan, done: int) -> int:
    """ZeRO-1 under overlap_comm with `--grad-accum K`: its hooks reduce only in the boundary micro-step
    (`reduce_ready_partitions_and_remove_grads` :1621-1622, `partition_gradients or
    is_gradient_accumulation_boundary`), so there each `.grad` accumulated whole over the K micro-steps until its
    hook moves it into the bucket (:1118): the gradients of the hooks after the first `done`, bytes."""
    return table(spec, plan).suffix[done]
