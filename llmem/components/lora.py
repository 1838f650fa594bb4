"""LoRA via PEFT (`--method lora`): the adapters' parameters and the activations the adapted Linears keep.

What runs: `peft.get_peft_model(model, LoraConfig(r, lora_alpha, lora_dropout, target_modules, bias="none",
task_type="CAUSAL_LM"))` (peft 0.21). Every targeted Linear (a module whose name equals a target or ends with
"." + target; `all-linear` = every Linear/Conv1D except the output layer) gets
  lora_A: Linear(in, r) -> weight (r, in);  lora_B: Linear(r, out) -> weight (out, r)
so it adds r * (in + out) trainable elements (Conv1D stores its weight (in, out); the count is the same).
PEFT casts bf16/fp16 adapters to fp32 (`autocast_adapter_dtype=True`), and fp32 bases make fp32 adapters: adapter
parameters, gradients and optimizer states are 4 bytes per element under every precision, except with
`--lora-adapter-dtype base` on a pure half base (`base_dtype_adapters`: 2 bytes, `adapter_elem_bytes`).
The base weights are frozen: no gradients, no optimizer states.

Forward of an adapted Linear (`peft/tuners/lora/layer.py: Linear.forward`):
  result = base_layer(x); x = x.to(lora_A.weight.dtype); result = result + lora_B(lora_A(dropout(x))) * scaling
Saved for backward, compared with full fine-tuning:
  - base_layer: mm saves only what the input gradient needs (its weight); its input is no longer saved for a weight
    gradient. The same holds for the frozen lm_head and for norm weights (`weight * normalized` saves no
    `normalized`).
  - lora_A saves its input: x itself when dropout is 0 (shared by the Linears that read the same x, e.g. q/k/v);
    with dropout > 0, each adapted Linear's own dropout output plus the dropout noise (CPU, x's dtype) or bool mask
    (CUDA) (`activations.dropout_saved`). Under autocast lora_A saves its own half-precision cast of that input;
    under pure half, `x.to(fp32)` is a per-Linear fp32 copy.
  - lora_B saves the A output, r per token, in the compute dtype of the adapter (fp32 unless autocast).
  - Under autocast the adapters' half-precision weight casts (cached: fp32 leaves that require grad) are saved.
  - FSDP2 (--zero 2/3) with bf16-/fp16-mixed (`half_adapters`): the `MixedPrecisionPolicy` all-gathers every
    parameter of a group — frozen base and fp32 adapters alike — cast to param_dtype, and no autocast runs, so the
    adapters compute in the half dtype: `x.to(lora_A.weight.dtype)` is a no-op, lora_dropout runs on the half x
    (noise and output half), lora_A saves that half x (with dropout 0 the x the group's Linears share: one copy),
    lora_B the half A output, and the unsharded adapter gradients are half until `foreach_reduce` copies them into
    its fp32 (reduce_dtype) reduce-scatter input.
  - Layer 0's input does not require grad (the embeddings are frozen), so its first norm saves nothing. There a frozen
    q_proj / k_proj without an adapter makes an output that does not require grad either, so qwen3's q_norm / k_norm
    on it (a frozen `Qwen3RMSNorm`) saves neither its fp32 input nor its rsqrt (sdpa still saves q / k, since another
    of its inputs requires grad).

`--lora-modules-to-save`: the trainable copies of the embedding and the output layer, `llmem.components.lora_copies`.
"""

from __future__ import annotations

import math

from llmem.components.lora_copies import (  # noqa: F401 (re-exported: `--lora-modules-to-save`)
    _EMBEDDINGS,
    _HEADS,
    _copy_sources,
    _module,
    _validate_modules_to_save,
    copy_bytes,
    module_copies,
    saved_module_names,
    trains_copy,
)
from llmem.components.lora_head import head_module
from llmem.derive import lora_experts as traced_experts  # a traced MoE's ParamWrappers
from llmem.errors import InputError
from llmem.plan import ALL_LINEAR, Method, TrainingPlan
from llmem.spec import ModelSpec, ParamTensor, TpSplit, per_spec

ADAPTER_BYTES = 4  # fp32 adapters under every precision (see module docstring)


def adapter_elem_bytes(spec: ModelSpec) -> int:
    """Bytes per adapter element: fp32, or bf16 where the engine casts them with the module (`spec.half_adapters`,
    DeepSpeed's bf16 engine)."""
    return 2 if getattr(spec, "half_adapters", False) else ADAPTER_BYTES


def base_dtype_adapters(plan: TrainingPlan) -> bool:
    """`--lora-adapter-dtype base` on a pure bf16/fp16 base: PEFT leaves the adapters in the base's 2-byte dtype
    (`get_peft_model(..., autocast_adapter_dtype=False)`: peft 0.21.2 `tuners/tuners_utils.py:2719` skips the fp32
    upcast; `tuners/lora/layer.py:314` moved them to the base layer's dtype). The estimate then reads the spec with
    half adapters (`spec.half_adapters`, `llmem.spec.program_spec`): 2-byte adapters, gradients and optimizer states,
    and the half activations of `lora_activations.layer_saved`'s `half`. fp32 and mixed precision: an fp32 base."""
    return is_lora(plan) and plan.lora_adapter_dtype.value == "base" and plan.precision.value in ("bf16", "fp16")


def half_adapters(plan: TrainingPlan) -> bool:
    """Whether the adapters compute in the half dtype: LoRA under FSDP2 with a MixedPrecisionPolicy (see module
    docstring). Everywhere else they compute in fp32 (or under autocast, on their half-precision casts)."""
    from llmem.components.sharding import FSDP_SCHEMES

    return is_lora(plan) and plan.scheme in FSDP_SCHEMES and plan.precision.is_mixed


def is_lora(plan: TrainingPlan) -> bool:
    """LoRA adapters on the frozen base: `--method lora`, and `--method qlora` (quantized base, `quant.py`)."""
    return plan.method in (Method.LORA, Method.QLORA)


def linear_weights(spec: ModelSpec) -> tuple[ParamTensor, ...]:
    """The weights of the spec's nn.Linear / Conv1D modules other than the output layer: 2-D `.weight` tensors that
    are not embeddings; MoE routers (`mlp.gate` of mixtral/qwen2_moe) are their own modules in transformers 5, and
    fused 3-D experts are not Linears."""
    return spec.memo(("lora.linear_weights",), lambda: tuple(_linear_weights(spec)))


def _linear_weights(spec: ModelSpec) -> list[ParamTensor]:
    out = []
    for p in spec.params:
        name = _module(p)
        last = name.rsplit(".", 1)[-1]
        if not p.name.endswith(".weight") or len(p.shape) != 2 or last in _EMBEDDINGS or last in _HEADS:
            continue
        if p.layer is None and name == head_module(spec):  # an untied head of its own name (BioGPT's output_projection)
            continue
        if spec.is_moe and name.endswith("mlp.gate"):
            continue
        out.append(p)
    return out


def _matches(module: str, target: str) -> bool:
    return module == target or module.endswith("." + target)


def targeted(spec: ModelSpec, plan: TrainingPlan) -> tuple[ParamTensor, ...]:
    """The base weights that get adapters, in spec order."""
    return spec.memo(("lora.targeted", plan.lora_targets), lambda: _targeted(spec, plan.lora_targets))


def layer0_targeted(spec: ModelSpec, plan: TrainingPlan) -> tuple[ParamTensor, ...]:
    """The targeted base weights of decoder layer 0 (every layer adapts the same Linears: `check_supported`)."""
    return spec.memo(("lora.layer0_targeted", plan.lora_targets),
                     lambda: tuple(p for p in targeted(spec, plan) if p.layer == 0))


def _targeted(spec: ModelSpec, targets: str) -> tuple[ParamTensor, ...]:
    linears = tuple(p for p in linear_weights(spec) if not traced_experts.maps(spec, _module(p)))  # PEFT's
    if targets == ALL_LINEAR:
        return linears
    names = targets.split(",")
    return tuple(p for p in linears if any(_matches(_module(p), t) for t in names))


def validate(spec: ModelSpec, plan: TrainingPlan) -> None:
    """Every named target must match a Linear of this model (PEFT only fails when none does); every name of
    --lora-modules-to-save a modelled module (embedding, lm_head) of an untied model."""
    _validate_modules_to_save(spec, plan)
    if not is_lora(plan) or plan.lora_targets == ALL_LINEAR:
        return
    modules = [_module(p) for p in linear_weights(spec)]
    for t in plan.lora_targets.split(","):
        if t.rsplit(".", 1)[-1] in _HEADS:
            from llmem.components.lora_head import check_supported

            check_supported(spec, plan, t)
            continue
        if not any(_matches(m, t) for m in modules) and not traced_experts.maps(spec, t):
            from llmem.components.lora_experts import v4_moe_name_refusal

            v4_moe_name_refusal(spec, t)
            known = sorted({m.rsplit(".", 1)[-1] for m in modules})
            raise InputError("lora-targets", f"{t!r} matches no Linear of {spec.model_type}; "
                             f"its Linears are: {', '.join(known)} (or all-linear)")


def in_out(spec: ModelSpec, p: ParamTensor) -> tuple[int, int]:
    if spec.family.conv1d:  # transformers' Conv1D: weight (in, out)
        return p.shape[0], p.shape[1]
    return p.shape[1], p.shape[0]


def adapter_params(spec: ModelSpec, plan: TrainingPlan) -> list[ParamTensor]:
    """lora_A (r, in) and lora_B (out, r) of every targeted Linear, named as PEFT names them (base_model.model.
    prefix omitted), in the layer of their base Linear."""
    r = plan.lora_rank
    out = []
    for p in targeted(spec, plan):
        i, o = in_out(spec, p)
        m = _module(p)
        a_split, b_split = _tp_splits(p, plan)
        out += [ParamTensor(f"{m}.lora_A.default.weight", (r, i), p.layer, a_split),
                ParamTensor(f"{m}.lora_B.default.weight", (o, r), p.layer, b_split)]
    from llmem.components import lora_experts, lora_head  # mixtral's experts (ParamWrapper); the output layer's

    experts = lora_experts.adapter_params(spec, plan) + traced_experts.adapter_params(spec, plan)
    return out + experts + lora_head.adapter_params(spec, plan)


def _tp_splits(p: ParamTensor, plan: TrainingPlan) -> tuple[TpSplit, TpSplit]:
    """(lora_A's, lora_B's) TP split: PEFT shards lora_B with a column-parallel base (`Shard(0)`, its out/T rows)
    and lora_A with a row-parallel one (`Shard(1)`), the other stays whole on every rank (`llmem.runtime.lora_tp`,
    `peft/tuners/lora/model.py:398-440`)."""
    if plan.tp == 1 or p.tp_split is TpSplit.NONE:
        return TpSplit.NONE, TpSplit.NONE
    return (TpSplit.NONE, TpSplit.COLWISE) if p.tp_split is TpSplit.COLWISE else (TpSplit.ROWWISE, TpSplit.NONE)


def _summary(spec: ModelSpec, plan: TrainingPlan) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(sizes of every adapter tensor, adapter elements per decoder layer, adapter elements outside the layers)."""
    return spec.memo(("lora_summary", plan.lora_rank, plan.lora_targets, plan.tp),
                     lambda: _adapter_summary(spec, plan))


def _adapter_summary(spec: ModelSpec, plan: TrainingPlan) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    from llmem.components.sharding import tp_local_shape

    sizes = [math.prod(tp_local_shape(a, plan.tp)) for a in adapter_params(spec, plan)]  # the rank's (TP) shard
    per_layer = [0] * spec.num_layers
    outer = 0
    for a, n in zip(adapter_params(spec, plan), sizes, strict=True):
        if a.layer is None:
            outer += n
        else:
            per_layer[a.layer] += n
    return tuple(sizes), tuple(per_layer), outer


@per_spec("layout_key")
def trainable_params(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Parameters the plan trains: all of them for full fine-tuning, the adapters' for LoRA (equal to PEFT's
    `get_nb_trainable_parameters()[0]`)."""
    if not is_lora(plan):
        return spec.trainable_params
    adapters = sum(a.numel for a in adapter_params(spec, plan))  # global: PEFT counts a DTensor's full numel
    return adapters + sum(p.numel for p in module_copies(spec, plan))


def total_params(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Every parameter of the model that runs (LoRA: base plus adapters)."""
    return spec.total_params + (trainable_params(spec, plan) if is_lora(plan) else 0)


def adapter_sizes(spec: ModelSpec, plan: TrainingPlan) -> list[int]:
    return list(_summary(spec, plan)[0])


def sharded_adapter_sizes(spec: ModelSpec, plan: TrainingPlan) -> list[int]:
    """FSDP2 (ZeRO-2/3): each adapter's padded shard on one rank, ceil(d0 / dp) rows (`fsdp_padded_numel`)."""
    from llmem.components.sharding import fsdp_shard_numel

    return [fsdp_shard_numel(a.shape, plan) for a in adapter_params(spec, plan)]


def sharded_layer_adapter_bytes(spec: ModelSpec, plan: TrainingPlan) -> list[int]:
    """FSDP2: the adapters' padded shards of each decoder layer on one rank (fp32: parameters, gradients)."""
    from llmem.components.sharding import fsdp_shard_numel

    per_layer = [0] * spec.num_layers
    for a in adapter_params(spec, plan):
        if a.layer is not None:
            per_layer[a.layer] += fsdp_shard_numel(a.shape, plan) * adapter_elem_bytes(spec)
    return per_layer


@per_spec("layout_key")
def sharded_outer_adapter_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    from llmem.components.sharding import fsdp_shard_numel

    return sum(fsdp_shard_numel(a.shape, plan) for a in adapter_params(spec, plan) if a.layer is None) \
        * adapter_elem_bytes(spec)


@per_spec("layout_key")
def gathered_adapter_numel(spec: ModelSpec, plan: TrainingPlan, layer: int | None) -> int:
    """FSDP2: elements of the adapters of decoder layer `layer` (None: of the root) while all-gathered — dp padded
    shards each, as the all-gather output holds them."""
    from llmem.components.sharding import fsdp_shard_numel

    return sum(fsdp_shard_numel(a.shape, plan) * plan.dp for a in adapter_params(spec, plan) if a.layer == layer)


@per_spec("layout_key")
def adapter_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Bytes of every trainable tensor (and of their gradients): the fp32 adapters and the module copies."""
    return sum(_summary(spec, plan)[0]) * adapter_elem_bytes(spec) + copy_bytes(spec, plan)


def trainable_tensors(spec: ModelSpec, plan: TrainingPlan) -> list[tuple[tuple[int, ...], int]]:
    """(shape, bytes per element) of each tensor the optimizer gets, in `model.parameters()` order: the embedding
    copy (registered where the embedding is), the adapters layer by layer, the lm_head copy."""
    copies = module_copies(spec, plan)
    pb = plan.precision.param_bytes
    heads = [c.name.removesuffix(".modules_to_save.default.weight").endswith(_HEADS) for c in copies]
    embed = [(c.shape, pb) for c, h in zip(copies, heads, strict=True) if not h]
    head = [(c.shape, pb) for c, h in zip(copies, heads, strict=True) if h]
    return embed + [(a.shape, adapter_elem_bytes(spec)) for a in adapter_params(spec, plan)] + head


def layer_adapter_bytes(spec: ModelSpec, plan: TrainingPlan, layer: int, elem_bytes: int | None = None) -> int:
    """The adapters of decoder layer `layer` (`elem_bytes`: 2 for their half unsharded gradients under FSDP2 mixed)."""
    return _summary(spec, plan)[1][layer] * (elem_bytes or adapter_elem_bytes(spec))


def outer_adapter_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    return _summary(spec, plan)[2] * adapter_elem_bytes(spec)


@per_spec("layout_key")
def largest_mlp_adapter_bytes(spec: ModelSpec, plan: TrainingPlan, elem_bytes: int | None = None) -> int:
    """The gradients of the adapters of a layer's last MLP Linear (its A and B), produced during its backward."""
    mlp = [p for p in layer0_targeted(spec, plan) if ".mlp." in p.name or ".fc" in p.name]
    if not mlp:
        return 0
    from llmem.components.sharding import tp_local_shape

    i, o = in_out(spec, mlp[-1])
    a_split, b_split = _tp_splits(mlp[-1], plan)  # under TP: the rank's shard of each
    a = tp_local_shape(ParamTensor("A", (plan.lora_rank, i), 0, a_split), plan.tp)
    b = tp_local_shape(ParamTensor("B", (o, plan.lora_rank), 0, b_split), plan.tp)
    return (math.prod(a) + math.prod(b)) * (elem_bytes or adapter_elem_bytes(spec))


# What the adapted layers keep for backward lives in its own module, which imports this one's terms; its terms are
# read through this one, resolved on first use (PEP 562), so either module may be imported first.
_ACTIVATION_TERMS = frozenset((
    "check_supported", "current_layer_backward_bytes", "final_norm_bytes", "first_layer_saving_bytes",
    "first_layer_unsaved_copy_bytes", "kept_layers_bytes", "layer_activation_bytes", "layer_adapter_cast_bytes",
    "layer_saved", "mlp_backward_gradient_bytes", "recompute_bytes", "traced_spec", "unsaved_adapter_copy_bytes"))


def __getattr__(name: str):
    if name not in _ACTIVATION_TERMS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from llmem.components import lora_activations

    globals().update({term: getattr(lora_activations, term) for term in _ACTIVATION_TERMS})
    return globals()[name]
