"""Which decoder layers the walk evaluates when a derived model's layers are of several kinds (`activations.varied`:
Gemma 2/3's sliding-window and full-attention layers, gpt-oss's alternating attention).

Every term a layer's backward moments read is one of: the layer's own (its kind, whether it is checkpointed, its
parameters), a prefix sum over the layers below it (their kept activations), a suffix sum over the layers above it
(their gradients), a linear term in its index, or a step that a held or shared saved tensor makes where it is
released (`Derived.held_released_bytes`, `Derived.outer_released_bytes`: at the lowest layer taking it). From the
last such release on, when the layers' own terms repeat every Q layers, a moment's total along the layers l, l + Q,
l + 2Q, ... changes by the same amount at each step (one period more below, one less above): it is linear there, so
its largest value, and the first of equal ones in the walk's last-first order, is at one of the two ends. The walk
then evaluates every layer up to one period past the last release, the last period, and the outermost layers —
the same peak and peak phase as all layers (`tests/derive/test_periodic.py` compares them)."""

from __future__ import annotations

from collections.abc import Callable

from llmem.plan import GradCkpt, TrainingPlan
from llmem.spec import ModelSpec


def backward_layers(spec: ModelSpec, plan: TrainingPlan, edge: int = 1) -> list[int]:
    """The layers to evaluate, last first (all of them when the layers do not repeat soon enough to save any)."""
    return spec.memo(("periodic layers", plan.key, edge), lambda: _layers(spec, plan, edge), per_plan=True)


def _layers(spec: ModelSpec, plan: TrainingPlan, edge: int) -> list[int]:
    n, signature = spec.num_layers, layer_signatures(spec, plan)
    for start in range(_last_release(spec, plan), n):  # the layers may repeat only past a first different one
        period = next((q for q in range(1, n - start) if signature[start:n - q] == signature[start + q:]), n)
        low, high = max(start + period, edge + 1), min(n - period, n - edge - 1)
        if low < high:
            return sorted({*range(low), *range(high, n)}, reverse=True)
    return list(range(n - 1, -1, -1))


def layer_signatures(spec: ModelSpec, plan: TrainingPlan) -> list[tuple]:
    """What each layer's own terms depend on: its kind, whether it is checkpointed, its parameters' shapes (layers
    of equal signatures have equal own terms: `activations.kept_layers_bytes` evaluates one of each)."""
    from llmem.components.activations import layer_plan  # a layer's kind under the plan it runs (`--ckpt-every`)

    def signatures():
        shapes = _layer_shapes(spec)
        kinds = {p: spec.derived.layer_kinds(p) for p in {layer_plan(plan, k) for k in range(min(2, spec.num_layers))}}
        return [(kinds[layer_plan(plan, k)][k], plan.checkpointed(k), shapes[k]) for k in range(spec.num_layers)]
    return spec.memo(("layer signatures", plan.key), signatures, per_plan=True)


def per_signature(spec: ModelSpec, plan: TrainingPlan, value: Callable[[int], int]) -> list[int]:
    """`value(layer)` for every decoder layer, evaluated at the first layer of each signature (`layer_signatures`)
    and repeated for the others."""
    signatures = layer_signatures(spec, plan)
    first: dict[tuple, int] = {}
    for layer, signature in enumerate(signatures):
        first.setdefault(signature, layer)
    values = {signature: value(layer) for signature, layer in first.items()}
    return [values[signature] for signature in signatures]


def _layer_shapes(spec: ModelSpec) -> list[tuple]:
    return spec.memo(("layer shapes",), lambda: [tuple(p.shape for p in spec.layer_params(k))
                                                 for k in range(spec.num_layers)])


def _last_release(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The highest layer at whose backward a held argument or a shared saved tensor is released (0: none)."""
    d = spec.derived
    lows = [low for low in d.lowest_holders(plan) if low is not None] if plan.grad_ckpt is GradCkpt.FULL else []
    lows += [min(layers) for layers in d.fitted(plan)["outer_layers"] if layers]
    return max(lows, default=0)
