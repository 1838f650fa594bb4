"""What the model is: `ModelSpec`, read from a Hugging Face `config.json` with an explicit adapter.

The spec lists every parameter tensor by its transformers name and shape (`ParamTensor`), so the parameter count is
exact in closed form and the sharding schemes (FSDP's per-tensor padding, ZeRO-1's greedy partition, TP's
column/row splits) can be computed tensor by tensor. No parallelism lives here: that is the `TrainingPlan`'s.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property

from llmem.errors import GAP, REFUSED, InputError
from llmem.memo import remembered

MEMO_LIMIT = 4096  # terms kept per spec (`ModelSpec.memo`)


def per_spec(key: str = "key"):
    """A component term `f(spec, plan, *args)` kept on the spec (`ModelSpec.memo`) per plan and arguments: `key`
    names the plan's key the term depends on — "key" (every field) or "layout_key" (every field but the micro-batch
    and the sequence length: terms over parameters)."""
    plan_key, per_plan = operator.attrgetter(key), key == "key"

    def wrap(compute):
        name = f"{compute.__module__}.{compute.__qualname__}"

        @functools.wraps(compute)
        def term(spec, plan, *args, **kwargs):
            memo_key = (name, plan_key(plan), args, tuple(kwargs.items()) if kwargs else ())
            value = (spec._plan_memo if per_plan else spec._memo).get(memo_key, _MISSING)
            if value is _MISSING:
                value = spec.memo(memo_key, lambda: compute(spec, plan, *args, **kwargs), per_plan)
            return value
        return term
    return wrap


_MISSING = object()


class TpSplit(str, Enum):
    """How Megatron-style tensor parallelism splits a tensor (DESIGN.md section 2)."""

    NONE = "replicated"
    COLWISE = "colwise"  # output features split: weight dim 0, bias dim 0
    ROWWISE = "rowwise"  # input features split: weight dim 1; bias replicated


@dataclass(frozen=True)
class ParamTensor:
    name: str
    shape: tuple[int, ...]
    layer: int | None = None  # decoder layer index; None for embeddings, final norm, lm_head
    tp_split: TpSplit = TpSplit.NONE

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ModelSpec:
    """An architecture's sizes, normalised across families (`llmem.families`; keys read: `llmem.config_keys`)."""

    model_type: str
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    options: dict = field(default_factory=dict, compare=False, hash=False)
    caveats: tuple[str, ...] = ()  # what the estimate cannot vouch for (e.g. a family without activation table)
    params: tuple[ParamTensor, ...] = field(default=(), repr=False, compare=False, hash=False)
    derived: object = field(default=None, repr=False, compare=False, hash=False)  # `llmem.derive.Derived`
    # LoRA adapters computing in the module's half dtype, as DeepSpeed's bf16 engine casts them (`walk.deepspeed`)
    half_adapters: bool = False
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)
    _plan_memo: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def memo(self, key: tuple, compute, per_plan: bool = False):
        """`compute()`, once per `key` for this spec: tables derived from the spec (and the plan fields in `key`)
        that the walks ask for many times per estimate. The spec is immutable, so a value never goes stale. Terms
        keyed by a whole plan (`per_plan`: `TrainingPlan.key`) are kept apart from those over the spec's structure,
        which many plans share; each store starts afresh at `MEMO_LIMIT` keys (values are recomputed when asked
        again), so a long-running app stays bounded."""
        return remembered(self._plan_memo if per_plan else self._memo, key, compute, MEMO_LIMIT)

    @cached_property
    def family(self):
        """The `llmem.families.Family` that describes this architecture's layer structure (asked dozens of times per
        estimate: kept on the spec, which is immutable)."""
        from llmem.families import FAMILIES

        family = FAMILIES.get(self.model_type)
        if family is None and self.derived is not None:  # traced from transformers (`llmem.derive`)
            return self.derived.family
        if family is None:  # e.g. a spec counted on the meta device (`llmem.meta`)
            raise unsupported_model_type(self.model_type)
        return family

    @cached_property
    def total_params(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def trainable_params(self) -> int:
        """Full fine-tuning trains every parameter."""
        return self.total_params

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @cached_property
    def supports_tp(self) -> bool:
        """A TP program exists: a hand-written unfused family's Megatron plan (`Family.tp_plan`), or the plan the
        model's config carries (`base_model_tp_plan`, applied by transformers: `llmem.derive.tp`): the configuration
        class's as `llmem.tp_plans` lists it (generated from transformers by scripts/gen_tp_plans.py: no import of
        transformers, which takes seconds in a fresh process), else read by building that class (a config that
        spells its own plan, or a model type the table does not list). Kept on the spec."""
        from llmem.families import FAMILIES
        from llmem.tp_plans import has_tp_plan

        if self.model_type in FAMILIES and self.family.tp_plan:
            return True
        config = getattr(self, "source_config", None) or getattr(self.derived, "config", None)
        if not config:
            return False
        listed = has_tp_plan(self.model_type)
        if listed is not None and "base_model_tp_plan" not in config:
            return listed
        from llmem.runtime.parallel import config_tp_plan

        return bool(config_tp_plan(config))

    def layer_params(self, layer: int) -> tuple[ParamTensor, ...]:
        return self._by_layer.get(layer, ())

    @property
    def outer_params(self) -> tuple[ParamTensor, ...]:
        """Parameters outside the decoder layers (embeddings, final norm, untied lm_head)."""
        return self._by_layer.get(None, ())

    @cached_property
    def _by_layer(self) -> dict:
        groups: dict = {}
        for p in self.params:
            groups.setdefault(p.layer, []).append(p)
        return {k: tuple(v) for k, v in groups.items()}

    @classmethod
    def from_config(cls, config: dict | str | bytes) -> ModelSpec:
        """Build from a config dict (or its JSON text). Unknown architectures raise `InputError`."""
        if isinstance(config, (str, bytes)):
            from llmem.sources import parse_json

            try:
                text = config.decode("utf-8-sig") if isinstance(config, bytes) else config
            except UnicodeDecodeError as e:
                raise InputError("config", f"not UTF-8 text (byte {e.start})") from None
            config = parse_json(text, "config.json", field="config")
        if hasattr(config, "to_dict"):  # a transformers PretrainedConfig
            config = config.to_dict()
        if not isinstance(config, dict):
            raise InputError("config", f"expected a JSON object, got {type(config).__name__}")
        model_type = config.get("model_type")
        if not isinstance(model_type, str) or not model_type:
            raise InputError("model_type", "missing from config.json; it names the architecture (e.g. \"llama\")")
        from llmem.families import FAMILIES

        family = FAMILIES.get(model_type)
        if family is None:  # parameters counted on the meta device, activations traced (`llmem.derive`)
            from llmem.derive import derived_spec

            return derived_spec(config)
        spec = family.build(config)
        object.__setattr__(spec, "source_config", config)  # LoRA's tables are traced from it (`lora.traced_spec`)
        return spec


def attention_implementation(model_type: str, attn) -> str:
    """The attention transformers runs for `--attn`: eager for the models that have no sdpa path.

    transformers 5.23.0 sets `_supports_sdpa = False` on some models (`Family.sdpa`; gemma2: sdpa has no
    attention-logit softcapping; bloom: ALiBi in its own eager attention) and raises when asked for
    attn_implementation="sdpa". `--attn sdpa` (the default) means "the fused kernel where the model has one": both
    the estimator and the runtime run these models' eager attention for it, as transformers does when no
    implementation is forced. A derived architecture (outside `llmem.families`) follows transformers' own fallback,
    read from its class (`llmem.derive.attention`: gpt_oss)."""
    from llmem.families import FAMILIES

    family = FAMILIES.get(model_type)
    if family is not None:
        return "eager" if not family.sdpa else str(attn)
    if str(attn) == "sdpa":  # a derived architecture: transformers' own fallback
        from llmem.derive.attention import supports_sdpa

        return "sdpa" if supports_sdpa(model_type) else "eager"
    return str(attn)


def modelled_spec(config: dict) -> ModelSpec:
    """`ModelSpec.from_config` for the estimator's front-ends: a `model_type` outside `llmem.families` that is not a
    decoder-only causal LM transformers ships is refused at once (one line naming `model_type`), without building
    it on the meta device first; one that is gets its activations derived (`llmem.derive`)."""
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if isinstance(model_type, str) and model_type:
        from llmem.derive import is_cached
        from llmem.families import FAMILIES

        if model_type not in FAMILIES and not (is_cached(config) or is_causal_lm(model_type)):
            raise unsupported_model_type(model_type)
    return ModelSpec.from_config(config)


def _auto_names() -> tuple[dict, dict, dict]:
    """transformers' (causal LM, encoder or seq2seq, every config) model_type tables; empty without transformers."""
    try:
        from transformers.models.auto import modeling_auto as auto
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    except ImportError:
        return {}, {}, {}
    encoders = {**getattr(auto, "MODEL_FOR_MASKED_LM_MAPPING_NAMES", {}),
                **getattr(auto, "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", {})}
    return getattr(auto, "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", {}), encoders, CONFIG_MAPPING_NAMES


def is_causal_lm(model_type: str) -> bool:
    """A decoder-only causal LM that transformers ships (an encoder with an LM head is not one)."""
    causal, encoders, _ = _auto_names()
    return model_type in causal and model_type not in encoders


def unsupported_model_type(model_type: str) -> InputError:
    """The one-line refusal of a `model_type` outside `llmem.families`: a causal LM transformers ships (support
    is planned), an architecture that is not a causal LM, or a name transformers does not know."""
    from llmem.families import FAMILIES

    modelled = ", ".join(sorted(FAMILIES))
    shown = model_type if len(model_type) <= 60 else model_type[:57] + "..."
    causal, encoders, CONFIG_MAPPING_NAMES = _auto_names()
    if model_type in causal and model_type not in encoders:
        return InputError("model_type", f"{shown!r} is not modelled yet (support for more architectures is "
                          f"planned); the modelled families are: {modelled}", GAP)
    if model_type in CONFIG_MAPPING_NAMES:
        return InputError("model_type", f"{shown!r} is not a causal language model (encoder, seq2seq or other "
                          f"head); llmem estimates decoder-only fine-tuning of: {modelled}", REFUSED)
    return InputError("model_type", f"{shown!r} is not an architecture transformers knows; check the spelling, "
                      f"or use one of the modelled families: {modelled}")


def program_spec(spec: ModelSpec, plan) -> ModelSpec:
    """The spec whose tables answer for `plan`: LoRA on a family without a hand-written LoRA table has its tables
    traced from the PEFT model (`components.lora_activations.traced_spec`), TP with the model's own plan its splits
    and tables traced under TP (`hf_tp_spec`); any other plan keeps `spec`. The estimate, the walk and compare ask
    it (memoized on the spec)."""
    from llmem.components.lora_activations import traced_spec

    spec = hf_tp_spec(traced_spec(spec, plan), plan)
    from llmem.components import lora

    if lora.base_dtype_adapters(plan) and not spec.half_adapters:  # `--lora-adapter-dtype base` on a half base
        from llmem.components.ds_lora import half_spec

        return half_spec(spec)
    return spec


def hf_tp_spec(spec: ModelSpec, plan) -> ModelSpec:
    """Under TP, a model without a hand-written Megatron plan (`Family.tp_plan`) runs the plan of its own config
    (`llmem.runtime.parallel`): its spec then has each parameter's split from that plan and activation tables
    traced under TP (`llmem.derive.tp.tp_spec`). Every other plan keeps `spec` (a model without any plan is refused
    by `llmem.estimate.validate_plan_for_model`)."""
    from llmem.components.lora import is_lora
    from llmem.families import FAMILIES

    megatron = spec.model_type in FAMILIES and FAMILIES[spec.model_type].tp_plan and not is_lora(plan)
    if plan.tp == 1 or megatron or not spec.supports_tp:  # LoRA + TP: transformers' plan (`runtime.lora_tp`)
        return spec
    from llmem.derive.tp import tp_spec

    return tp_spec(spec, plan.tp)
