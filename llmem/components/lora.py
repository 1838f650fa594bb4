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

`--lora-modules-to-save NAMES` (`LoraConfig(modules_to_save=[...])`, `peft/utils/other.py: _set_trainable`,
`ModulesToSaveWrapper`): every module whose full name ends with a name is wrapped; the wrapper keeps the frozen
`original_module` and a trainable `copy.deepcopy` of it, `modules_to_save["default"]`, which is what runs in forward.
The copy keeps the module's dtype (PEFT does not cast it): a second weight of the plan's parameter dtype, trained like
full fine-tuning trains it (gradient and optimizer states in that dtype). Modelled for the input embedding
(`embed_tokens`) and the output layer (`lm_head`) of untied models:
  - lm_head copy: its input (the final norm output, or its autocast cast) is saved for the weight gradient, and its
    backward makes the V × h weight gradient (in the compute dtype; cast to the fp32 `.grad` under autocast).
  - embed_tokens copy: its output requires grad, so layer 0 saves what every other layer saves; its backward gets
    the tokens × h input gradient and `embedding_dense_backward` makes the dense V × h `.grad` (the ids it saves
    are the input tensor itself).
With tied embeddings PEFT deep-copies each wrapped module on its own and warns that the tie is broken (the copy
of one side trains, the other side keeps the frozen shared weight): refused, not modelled.
"""

from __future__ import annotations

import math

from llmem.derive import lora_experts as traced_experts  # a traced MoE's ParamWrappers
from llmem.errors import InputError
from llmem.plan import ALL_LINEAR, Method, TrainingPlan
from llmem.spec import ModelSpec, ParamTensor, TpSplit, per_spec

ADAPTER_BYTES = 4  # fp32 adapters under every precision (see module docstring)
_EMBEDDINGS = ("embed_tokens", "wte", "wpe", "embed_positions", "word_embeddings", "embed_in")
_HEADS = ("lm_head", "embed_out")


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


def _module(p: ParamTensor) -> str:
    return p.name.removesuffix(".weight")


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
        if spec.is_moe and name.endswith("mlp.gate"):
            continue
        out.append(p)
    return out


def saved_module_names(plan: TrainingPlan) -> list[str]:
    return plan.lora_modules_to_save.split(",") if is_lora(plan) and plan.lora_modules_to_save else []


def _copy_kind(spec: ModelSpec, p: ParamTensor) -> str | None:
    """"embed" for the input embedding table, "head" for the output layer's weight, else None (always None inside
    the decoder layers, so callers look only at `spec.outer_params`)."""
    if p.layer is not None or not p.name.endswith(".weight") or len(p.shape) != 2:
        return None
    last = _module(p).rsplit(".", 1)[-1]
    if last in _HEADS:
        return "head"
    if last in _EMBEDDINGS and p.shape[0] == spec.vocab_size:
        return "embed"
    return None


def _copy_sources(spec: ModelSpec) -> tuple[tuple[str, str, ParamTensor], ...]:
    """(kind, module name, weight) of each module `--lora-modules-to-save` can copy, in spec order: the input
    embedding and the lm_head. A tied model's lm_head is a module of its own whose weight is the embedding's:
    PEFT 0.21.2 without `ensure_weight_tying` (our `LoraConfig`'s default) wraps each named module separately
    (`tuners_utils.py:1454-1460` warns that the tie breaks), so its copy has the embedding's shape and the frozen
    original stays the one shared tensor (`ModulesToSaveWrapper`, `utils/other.py`: `copy.deepcopy` of the module)."""
    return spec.memo(("lora.copy_sources",), lambda: _find_copy_sources(spec))


def _find_copy_sources(spec: ModelSpec) -> tuple[tuple[str, str, ParamTensor], ...]:
    out = [(k, _module(p), p) for p in spec.outer_params if (k := _copy_kind(spec, p))]
    embed = next((p for k, _, p in out if k == "embed"), None)
    if spec.tie_word_embeddings and embed is not None and not any(k == "head" for k, _, _ in out):
        out.append(("head", "lm_head", embed))
    return tuple(out)


def module_copies(spec: ModelSpec, plan: TrainingPlan) -> list[ParamTensor]:
    """The trainable `modules_to_save["default"]` weights (in spec order: embedding first, then lm_head), named as
    PEFT names them; each has its module's shape and the plan's parameter dtype."""
    names = saved_module_names(plan)
    return [ParamTensor(f"{m}.modules_to_save.default.weight", p.shape, None)
            for _, m, p in _copy_sources(spec) if any(m.endswith(n) for n in names)]


@per_spec("layout_key")
def trains_copy(spec: ModelSpec, plan: TrainingPlan, kind: str) -> bool:
    """Whether the plan trains a copy of the embedding ("embed") or of the lm_head ("head")."""
    names = saved_module_names(plan)
    return any(k == kind and any(m.endswith(n) for n in names) for k, m, _ in _copy_sources(spec))


@per_spec("layout_key")
def copy_bytes(spec: ModelSpec, plan: TrainingPlan, kind: str | None = None) -> int:
    """Bytes of the trainable copies (of one kind, or all): the plan's parameter dtype. Their gradients have the
    same size."""
    kinds = {k for k, _, _ in _copy_sources(spec) if (kind is None or k == kind) and trains_copy(spec, plan, k)}
    return sum(p.numel for k, _, p in _copy_sources(spec) if k in kinds) * plan.precision.param_bytes


def _validate_modules_to_save(spec: ModelSpec, plan: TrainingPlan) -> None:
    names = saved_module_names(plan)
    if not names:
        return
    modules = sorted({p.name.rsplit(".", k)[0] for p in spec.params for k in range(1, p.name.count(".") + 1)})
    modelled = sorted({_module(p).rsplit(".", 1)[-1] for p in spec.params if _copy_kind(spec, p)})
    if spec.tie_word_embeddings:  # the tied lm_head is a module of its own, its weight the embedding's
        modules.append("lm_head")
        modelled = sorted({*modelled, "lm_head"})
    for n in names:
        hits = [m for m in modules if m.endswith(n)]
        if not hits:
            raise InputError("lora-modules-to-save", f"{n!r} matches no module of {spec.model_type}; the modelled "
                             f"names are: {', '.join(modelled)}")
        bad = [m for m in hits if m.rsplit(".", 1)[-1] not in modelled]
        if bad:
            raise InputError("lora-modules-to-save", f"{n!r} matches {bad[0]}, a module whose trainable copy is not "
                             f"modelled; the modelled names are: {', '.join(modelled)}")


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
    "layer_saved", "mlp_backward_gradient_bytes", "recompute_bytes", "traced_spec"))


def __getattr__(name: str):
    if name not in _ACTIVATION_TERMS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from llmem.components import lora_activations

    globals().update({term: getattr(lora_activations, term) for term in _ACTIVATION_TERMS})
    return globals()[name]
