"""Communication buffers of the data-parallel schemes (torch 2.13 DDP and FSDP2).

DDP (and ZeRO-1, which runs under DDP): `Reducer` allocates flat gradient buckets, one full copy of the gradients
in the parameters' dtype, at construction (`gradient_as_bucket_view=False`: the `.grad` tensors come on top).
FSDP2 (`fully_shard`): each decoder layer's parameters are all-gathered into unsharded tensors (padded to a
multiple of the data-parallel degree, in `MixedPrecisionPolicy.param_dtype`) before its forward and backward;
ZeRO-3 frees them after the layer's forward, ZeRO-2 keeps them until its backward. The root module (embeddings,
final norm, lm_head) stays gathered from its forward to its backward. Backward prefetches the next layer's
all-gather, and reduce-scatters each layer's unsharded gradients (in `reduce_dtype`, fp32 under mixed precision).
"""

from __future__ import annotations

from collections.abc import Callable

from llmem.components.sharding import FSDP_SCHEMES, unsharded_numel
from llmem.plan import Scheme, TrainingPlan
from llmem.spec import ModelSpec


def ddp_bucket_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    if plan.scheme not in (Scheme.DDP, Scheme.ZERO1):
        return 0
    return spec.total_params * plan.precision.param_bytes


def standing_buffer_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Buffers alive through the whole iteration."""
    return ddp_bucket_bytes(spec, plan)


def _gather_bytes(plan: TrainingPlan) -> int:
    """Bytes per element of all-gathered parameters: the MixedPrecisionPolicy's param_dtype, else the params'."""
    return plan.precision.compute_bytes if plan.precision.is_mixed else plan.precision.param_bytes


def layer_unsharded_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    return sum(unsharded_numel(p, plan) for p in spec.layer_params(0)) * _gather_bytes(plan)


def root_unsharded_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    return sum(unsharded_numel(p, plan) for p in spec.outer_params) * _gather_bytes(plan)


def gathered_parameter_bytes(spec: ModelSpec, plan: TrainingPlan) -> Callable[[int], int]:
    """f(n): all-gathered parameter bytes when n decoder layers have run forward (n = layers at the loss) or,
    in backward, when layers 0..n-1 still await their backward."""
    if plan.scheme not in FSDP_SCHEMES:
        return lambda n: 0
    layer, root = layer_unsharded_bytes(spec, plan), root_unsharded_bytes(spec, plan)
    if plan.scheme is Scheme.ZERO2:
        return lambda n: root + n * layer
    return lambda n: root + (2 * layer if n < spec.num_layers else 0)


def backward_transient_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """FSDP2 reduce-scatter input of one layer: its unsharded gradients in the reduce dtype."""
    if plan.scheme not in FSDP_SCHEMES:
        return 0
    return sum(unsharded_numel(p, plan) for p in spec.layer_params(0)) * plan.precision.param_bytes
