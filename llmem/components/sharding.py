"""How many elements of each parameter one rank stores, per scheme (DESIGN.md section 2).

- TP (`torch.distributed.tensor.parallel`): colwise tensors keep dim 0 / tp rows, rowwise weights dim 1 / tp columns.
- FSDP2 (`fully_shard`): each tensor is chunked on dim 0 over the data-parallel ranks and padded to the largest chunk,
  ceil(d0 / dp) rows (`torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam._init_sharded_param`).
The per-GPU figure is the largest rank's, so padded sizes are exact for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmem.plan import FsdpShard, Scheme, TrainingPlan
from llmem.spec import ModelSpec, ParamTensor, TpSplit

FSDP_SCHEMES = (Scheme.ZERO2, Scheme.ZERO3, Scheme.TP_ZERO3)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def tp_local_shape(p: ParamTensor, tp: int) -> tuple[int, ...]:
    """The shape one TP rank holds (ceil split, as DTensor's Shard placement gives the first ranks the extra)."""
    if tp == 1 or p.tp_split is TpSplit.NONE:
        return p.shape
    # colwise: the output features, dim -2 (dim 0 of a 2-D weight, of a 3-D expert stack's (E, out, in)), dim 0 of
    # a 1-D tensor; rowwise: the input features, the last dim
    dim = (0 if len(p.shape) == 1 else len(p.shape) - 2) if p.tp_split is TpSplit.COLWISE else len(p.shape) - 1
    shape = list(p.shape)
    shape[dim] = ceil_div(shape[dim], tp)
    return tuple(shape)


def fsdp_padded_numel(shape: tuple[int, ...], dp: int) -> int:
    """FSDP2's padded shard: ceil(d0 / dp) rows of the remaining dims."""
    return ceil_div(shape[0], dp) * math.prod(shape[1:])


def fsdp_shard_dim(shape: tuple[int, ...], plan: TrainingPlan) -> int:
    """The dim FSDP2 shards a tensor on: 0, or 1 under `--fsdp-shard dim1-if-short` for a tensor with fewer dim-0
    rows than ranks whose dim 1 divides evenly (`Shard(dim > 0)` must be even: `FSDPParam._init_sharded_param`)."""
    short = plan.fsdp_shard is FsdpShard.DIM1_IF_SHORT and len(shape) >= 2 and shape[0] < plan.dp
    return 1 if short and shape[1] % plan.dp == 0 else 0


def fsdp_shard_numel(shape: tuple[int, ...], plan: TrainingPlan) -> int:
    """One rank's FSDP2 shard of a tensor: padded on dim 0, or exactly 1/dp when sharded on dim 1."""
    if fsdp_shard_dim(shape, plan):
        return math.prod(shape) // plan.dp
    return fsdp_padded_numel(shape, plan.dp)


_LOCAL_NUMEL: dict = {}  # (shape, split, tp, dp, fsdp, rule) -> elements; shapes repeat across layers


def local_numel(p: ParamTensor, plan: TrainingPlan) -> int:
    """Elements of `p` stored on the largest rank."""
    fsdp = plan.scheme in FSDP_SCHEMES
    key = (p.shape, p.tp_split, plan.tp, plan.dp, fsdp, fsdp and plan.fsdp_shard)
    n = _LOCAL_NUMEL.get(key)
    if n is None:
        shape = tp_local_shape(p, plan.tp)
        n = _LOCAL_NUMEL[key] = fsdp_shard_numel(shape, plan) if fsdp else math.prod(shape)
    return n


def unsharded_numel(p: ParamTensor, plan: TrainingPlan) -> int:
    """Elements of `p` while gathered for compute: the TP-local tensor (FSDP all-gather output keeps the padding)."""
    shape = tp_local_shape(p, plan.tp)
    if plan.scheme in FSDP_SCHEMES:
        return fsdp_shard_numel(shape, plan) * plan.dp
    return math.prod(shape)


@dataclass(frozen=True)
class ShardSummary:
    """Per-rank element counts of a spec under one sharding (the same for every plan with equal tp, dp, FSDP)."""

    sizes: tuple[int, ...]  # local elements of each tensor, in spec.params order
    per_layer: tuple[int, ...]  # local elements of each decoder layer
    outer: int  # local elements outside the decoder layers
    # elements of a decoder layer while all-gathered (FSDP2 keeps the padding; TP-local): the largest layer's (a
    # bound where the layer is not known), and each layer's (`gathered_layers`: DeepSeek's dense first layers,
    # Qwen3-MoE's dense layers among the expert ones are smaller; docs/notes/2026-11-28-per-layer-gathers.md)
    gathered_layer: int
    gathered_outer: int  # the same for the tensors outside the decoder layers
    later: tuple[int, ...] = ()  # later[l]: local elements of the decoder layers after l (suffix sums of per_layer)
    gathered_layers: tuple[int, ...] = ()  # gathered_layers[l]: decoder layer l's elements while all-gathered

    @property
    def total(self) -> int:
        return (self.later[0] + self.per_layer[0] if self.per_layer else 0) + self.outer


def shard_summary(spec: ModelSpec, plan: TrainingPlan) -> ShardSummary:
    """Cached on the spec: an estimate needs these sums in many places, and compare calls it many times."""
    key = ("shard_summary", plan.tp, plan.dp, plan.scheme in FSDP_SCHEMES, plan.fsdp_shard)
    return spec.memo(key, lambda: _shard_summary(spec, plan))


def _shard_summary(spec: ModelSpec, plan: TrainingPlan) -> ShardSummary:
    sizes = tuple(local_numel(p, plan) for p in spec.params)
    per_layer = [0] * spec.num_layers
    outer = 0
    for p, n in zip(spec.params, sizes, strict=True):
        if p.layer is None:
            outer += n
        else:
            per_layer[p.layer] += n
    later = [0] * spec.num_layers
    for layer in range(spec.num_layers - 2, -1, -1):
        later[layer] = later[layer + 1] + per_layer[layer + 1]
    gathered = tuple(_gathered_per_layer(spec, plan))
    return ShardSummary(
        sizes, tuple(per_layer), outer,
        gathered_layer=max(gathered, default=0),
        gathered_outer=sum(unsharded_numel(p, plan) for p in spec.outer_params),
        later=tuple(later), gathered_layers=gathered,
    )


def _gathered_per_layer(spec: ModelSpec, plan: TrainingPlan) -> list[int]:
    gathered = [0] * spec.num_layers
    for p in spec.params:
        if p.layer is not None:
            gathered[p.layer] += unsharded_numel(p, plan)
    return gathered


def local_params(spec: ModelSpec, plan: TrainingPlan) -> int:
    return shard_summary(spec, plan).total
