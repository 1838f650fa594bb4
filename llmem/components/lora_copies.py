"""`--lora-modules-to-save NAMES` (`LoraConfig(modules_to_save=[...])`, `peft/utils/other.py: _set_trainable`,
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

from llmem.components.lora_head import head_module
from llmem.errors import InputError
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec, ParamTensor, per_spec

_EMBEDDINGS = ("embed_tokens", "wte", "wpe", "embed_positions", "word_embeddings", "embed_in")
_HEADS = ("lm_head", "embed_out")


def _module(p: ParamTensor) -> str:
    return p.name.removesuffix(".weight")


def saved_module_names(plan: TrainingPlan) -> list[str]:
    from llmem.components.lora import is_lora

    return plan.lora_modules_to_save.split(",") if is_lora(plan) and plan.lora_modules_to_save else []


def _copy_kind(spec: ModelSpec, p: ParamTensor) -> str | None:
    """"embed" for the input embedding table, "head" for the output layer's weight, else None (always None inside
    the decoder layers, so callers look only at `spec.outer_params`)."""
    if p.layer is not None or not p.name.endswith(".weight") or len(p.shape) != 2:
        return None
    last = _module(p).rsplit(".", 1)[-1]
    if last in _HEADS or _module(p) == head_module(spec):
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
        out.append(("head", head_module(spec), embed))
    return tuple(out)


def module_copies(spec: ModelSpec, plan: TrainingPlan) -> list[ParamTensor]:
    """The trainable `modules_to_save["default"]` weights (in spec order: embedding first, then lm_head), named as
    PEFT names them; each has its module's shape and the plan's parameter dtype."""
    names = saved_module_names(plan)
    if not names:
        return []
    return [ParamTensor(f"{m}.modules_to_save.default.weight", p.shape, None)
            for _, m, p in _copy_sources(spec) if any(m.endswith(n) for n in names)]


@per_spec("layout_key")
def trains_copy(spec: ModelSpec, plan: TrainingPlan, kind: str) -> bool:
    """Whether the plan trains a copy of the embedding ("embed") or of the lm_head ("head")."""
    names = saved_module_names(plan)
    if not names:
        return False
    return any(k == kind and any(m.endswith(n) for n in names) for k, m, _ in _copy_sources(spec))


@per_spec("layout_key")
def copy_bytes(spec: ModelSpec, plan: TrainingPlan, kind: str | None = None) -> int:
    """Bytes of the trainable copies (of one kind, or all): the plan's parameter dtype. Their gradients have the
    same size."""
    if not saved_module_names(plan):
        return 0
    kinds = {k for k, _, _ in _copy_sources(spec) if (kind is None or k == kind) and trains_copy(spec, plan, k)}
    return sum(p.numel for k, _, p in _copy_sources(spec) if k in kinds) * plan.precision.param_bytes


def _validate_modules_to_save(spec: ModelSpec, plan: TrainingPlan) -> None:
    names = saved_module_names(plan)
    if not names:
        return
    modules = sorted({p.name.rsplit(".", k)[0] for p in spec.params for k in range(1, p.name.count(".") + 1)})
    modelled = sorted({_module(p).rsplit(".", 1)[-1] for p in spec.params if _copy_kind(spec, p)})
    if spec.tie_word_embeddings:  # the tied lm_head is a module of its own, its weight the embedding's
        head = head_module(spec)
        modules.append(head)
        modelled = sorted({*modelled, head.rsplit(".", 1)[-1]})
    for n in names:
        hits = [m for m in modules if m.endswith(n)]
        if not hits:
            raise InputError("lora-modules-to-save", f"{n!r} matches no module of {spec.model_type}; the modelled "
                             f"names are: {', '.join(modelled)}")
        bad = [m for m in hits if m.rsplit(".", 1)[-1] not in modelled]
        if bad:
            raise InputError("lora-modules-to-save", f"{n!r} matches {bad[0]}, a module whose trainable copy is not "
                             f"modelled; the modelled names are: {', '.join(modelled)}")
