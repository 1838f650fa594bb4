"""Autocast weight copies under bf16-/fp16-mixed precision (torch.autocast, not FSDP2's MixedPrecisionPolicy).

`torch.autocast` casts each Linear weight to the half dtype once per autocast region and caches the copy; matmul
saves it for backward, so a layer's copies live from its forward to its backward: bytes = linear_weights * 2.
Backward runs outside the autocast region, whose exit clears the cache: a checkpointed layer's copies (not saved by
autograd: the checkpoint drops its saved tensors) are freed then and exist again only while its recompute (under
the forward's autocast state) and backward run.
The embedding is not an autocast op (no copy); lm_head is. In backward, the half-precision weight gradient is cast
to the fp32 `.grad` (`_to_copy` backward), so the largest weight's half gradient exists transiently. In a decoder
layer's backward that copy is freed before the activation's backward makes the MLP's second intermediate-sized
gradient (the moment `gradients.layer_backward_peak_extra_bytes` models), so it does not add to that moment.
"""

from __future__ import annotations

from llmem.components.sharding import local_numel
from llmem.plan import GradCkpt, Method, TrainingPlan
from llmem.spec import ModelSpec, per_spec


def applies(plan: TrainingPlan) -> bool:
    """Whether the forward runs under `torch.autocast` (mixed precision outside FSDP's own policies)."""
    from llmem.components.sharding import FSDP_SCHEMES

    return plan.precision.is_mixed and plan.scheme not in FSDP_SCHEMES


def _linear_weights(spec: ModelSpec, layer: int) -> list:
    return [p for p in spec.layer_params(layer) if p.name.endswith(".weight") and len(p.shape) >= 2]


def weight_copy_bytes(spec: ModelSpec, plan: TrainingPlan, kept=lambda name: True, layer: int = 0) -> int:
    """The half copies autocast makes of decoder layer `layer`'s Linear weights whose name `kept` accepts (0 when
    autocast does not apply): the one sum the moments' copy terms below and in `attention_core` take over their own
    Linears."""
    if not applies(plan):
        return 0
    from llmem.components.quant import quantized_weights

    quantized = {p.name for p in quantized_weights(spec, plan)}  # 4-bit/8-bit Linears: no autocast copy
    return sum(local_numel(p, plan) for p in _linear_weights(spec, layer)
               if kept(p.name) and p.name not in quantized) * plan.precision.compute_bytes


@per_spec("layout_key")
def each_layer_copy_bytes(spec: ModelSpec, plan: TrainingPlan) -> tuple[int, ...]:
    """Each decoder layer's own half weight copies (`weight_copy_bytes` of that layer): layers of several kinds have
    their own Linears (DeepSeek's dense first layers, `first_k_dense_replace`: a wide MLP where the later layers
    have a narrow shared expert; the stacked experts are 3-D parameters, `aten._grouped_mm`'s inputs, counted in
    the traced tables)."""
    kinds, first = _layer_kinds(spec)
    per_kind = [weight_copy_bytes(spec, plan, layer=i) for i in first]
    return tuple(per_kind[k] for k in kinds)


def _layer_kinds(spec: ModelSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(each decoder layer's kind, each kind's first layer): layers whose Linear weights have the same names within
    the layer, shapes and TP splits hold the same copies (a 4,096-layer plan search asks for them per plan)."""

    def kinds() -> tuple[tuple[int, ...], tuple[int, ...]]:
        of_layer, first, index = [], [], {}
        for i in range(spec.num_layers):
            signature = tuple((p.name.split(f".{i}.", 1)[-1], p.shape, p.tp_split) for p in _linear_weights(spec, i))
            kind = index.setdefault(signature, len(first))
            if kind == len(first):
                first.append(i)
            of_layer.append(kind)
        return tuple(of_layer), tuple(first)

    return spec.memo(("autocast.layer_kinds",), kinds)


@per_spec("layout_key")
def layer_weight_copy_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    return weight_copy_bytes(spec, plan)


@per_spec("layout_key")
def released_by_mlp_backward_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """At a dense decoder layer's backward moment (`gradients.layer_backward_peak_extra_bytes`: the MLP's last Linear
    has run backward) that Linear's MmBackward0 has released the half weight copy it saved; the layer's other copies
    are still saved. The last Linear is the MLP weight registered last (down_proj, c_proj, fc2, dense_4h_to_h).
    A derived architecture's traced backward moment already counts the copies released by then."""
    if not applies(plan) or spec.is_moe or plan.method is not Method.FULL or spec.derived is not None:
        return 0
    mlp = [p for p in _linear_weights(spec, 0) if ".mlp." in p.name or ".fc" in p.name]
    return local_numel(mlp[-1], plan) * plan.precision.compute_bytes if mlp else 0


def forward_copy_layers(spec: ModelSpec, plan: TrainingPlan, count: int) -> int:
    """Of decoder layers 0 .. count-1, how many hold their weight copies at the end of forward (the autocast region
    still open): all of them, in autocast's cache (`cached_cast` keeps the cast of a leaf fp32 weight that requires
    grad, aten/src/ATen/autocast_mode.cpp) — except where the Linears multiply by `weight.T`
    (`Family.transposed_weight_matmul`): the cast of a view is never cached (`!arg.is_view()`), so a copy lives
    only where the matmul saved it, in the layers not checkpointed (`saved_layer_copies`)."""
    if spec.family.transposed_weight_matmul:
        return saved_layer_copies(plan, count)
    return count


def saved_layer_copies(plan: TrainingPlan, count: int) -> int:
    """Of decoder layers 0 .. count-1, how many keep their weight copies into backward: those not checkpointed."""
    if plan.grad_ckpt is GradCkpt.SELECTIVE:  # every layer checkpointed; the policy saves no weight copy
        return 0
    if plan.grad_ckpt is not GradCkpt.FULL:
        return count
    return count - -(-count // plan.ckpt_every)  # layers 0, K, 2K, ... are checkpointed


def _head_weight_numel(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The lm_head weight: vocab × its input width, which is OPT's word_embed_proj_dim when project_out exists
    (opt-350m: 512, not the hidden 1024). Under TP with the model's own plan (`llmem.derive.tp`) the lm_head is
    `colwise_gather_output` (tied: the vocab-sharded embedding): the rank's ceil(vocab / tp) rows."""
    from llmem.components.activations import _proj_dim
    from llmem.spec import TpSplit

    shape = (spec.vocab_size, _proj_dim(spec))
    split = plan.tp > 1 and any(p.layer is None and p.shape == shape and p.tp_split is TpSplit.COLWISE
                                for p in spec.params)
    return (-(-shape[0] // plan.tp) if split else shape[0]) * shape[1]


def head_weight_copy_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    if not applies(plan):
        return 0
    return _head_weight_numel(spec, plan) * plan.precision.compute_bytes


def head_gradient_copy_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The half-precision lm_head weight gradient before its cast to fp32.

    The lm_head's backward is two moments: in MmBackward0 the half weight gradient is made while the node's saved
    weight copy and the incoming logits gradient are alive (the fp32 `.grad` does not exist yet); the engine frees
    both when the node returns, and only then ToCopyBackward0 casts the half gradient to the fp32 one
    (`head_fp32_gradient_bytes`), the half gradient still alive."""
    return head_weight_copy_bytes(spec, plan)


def head_fp32_gradient_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The fp32 lm_head weight gradient ToCopyBackward0 returns (0 when autocast does not apply)."""
    if not applies(plan):
        return 0
    return _head_weight_numel(spec, plan) * plan.precision.param_bytes


@per_spec("layout_key")
def attention_backward_weight_copy_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Falcon (parallel attention) in its attention core's backward: of the layer's own copies only those of the
    Linears whose backward has not run yet are left (query_key_value); the MLP's and `dense`'s were released with
    their matmuls' saved tensors."""
    return weight_copy_bytes(spec, plan, lambda name: ".mlp." not in name and "self_attention.dense" not in name)
