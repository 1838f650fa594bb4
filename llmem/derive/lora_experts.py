"""LoRA on a traced mixture of experts whose MLP names PEFT maps onto the fused experts (torch-free).

PEFT 0.21.2 rewrites the LoRA config of a transformers-5 model whose checkpoint conversion pattern has a MoE target
mapping (`peft/utils/transformers_weight_conversion.py:_convert_peft_config_moe`, 402-482;
`convert_peft_config_for_transformers`, 485-506). transformers 5.23 (`conversion_mapping.py:49-73, 142`) gives the
`qwen2_moe` pattern to `PATTERN_QWEN2_MOE` below; PEFT's `_MOE_TARGET_MODULE_MAPPING["qwen2_moe"]` (332-345) maps
`gate` -> `gate.weight` (the router), `gate_proj`/`up_proj` -> `gate_up_proj` and `down_proj` -> `down_proj` (the
3-D expert stacks), and `all-linear` resolves to the attention Linears plus those four names
(`_resolve_string_target_modules`, 357-373). The MLP names leave `target_modules` for `target_parameters`, so a shared
expert's Linears (deepseek, glm4_moe) stay frozen. `gate_proj` without `up_proj` (or the reverse) raises
(`Cannot convert PEFT target(s)`, 460-466); both double rank and alpha for `gate_up_proj` (`rank_pattern`, 468-479).

Each adapted parameter becomes a `ParamWrapper` (`peft/tuners/lora/layer.py:2335`; `update_layer`, 2413-2497):
lora_A (r·E, in) and lora_B (out, r·E), E = 1 for the 2-D router; it refuses lora_dropout > 0 (2462-2465). The
forward's materialised stacks and their gradients are in the traced program (`llmem.derive.trace` runs the PEFT
model); what the inventory lacks are the adapters themselves, `adapter_params`.
"""

from __future__ import annotations

from llmem.errors import REFUSED, InputError
from llmem.plan import ALL_LINEAR, TrainingPlan
from llmem.spec import ModelSpec, ParamTensor

PATTERN_QWEN2_MOE = frozenset({
    "afmoe", "beam", "cohere2_moe", "deepseek_v2", "deepseek_v3", "deepseek_v32", "dots1", "ernie4_5_moe",
    "exaone_moe", "flex_olmo", "glm4_moe", "glm4_moe_lite", "glm4v_moe", "glm_moe_dsa", "hunyuan_v1_moe",
    "longcat_flash", "mellum", "olmoe", "qwen3_moe", "qwen3_next", "qwen3_omni_moe", "qwen3_omni_moe_text",
    "qwen3_omni_moe_thinker", "solar_open"})
MAPPED = ("gate", "gate_proj", "up_proj", "down_proj")  # `_MOE_TARGET_MODULE_MAPPING["qwen2_moe"]`'s keys


def converted(spec: ModelSpec) -> bool:
    """Whether PEFT rewrites MLP names onto this traced model's fused experts."""
    return spec.derived is not None and spec.is_moe and spec.model_type in PATTERN_QWEN2_MOE


def maps(spec: ModelSpec, name: str) -> bool:
    """Whether PEFT maps this target (or Linear) name onto the router or fused experts, off `target_modules`."""
    return converted(spec) and name.rsplit(".", 1)[-1] in MAPPED


def mapped_targets(spec: ModelSpec, plan: TrainingPlan) -> frozenset:
    """The names of `MAPPED` the plan's targets reach (all of them with `all-linear`); none unless `converted`."""
    if not converted(spec):
        return frozenset()
    if plan.lora_targets == ALL_LINEAR:
        return frozenset(MAPPED)
    return frozenset(t.rsplit(".", 1)[-1] for t in plan.lora_targets.split(",")) & frozenset(MAPPED)


def check(spec: ModelSpec, plan: TrainingPlan) -> None:
    """PEFT's own refusals on the converted targets: a half of the fused gate_up_proj, and dropout."""
    names = mapped_targets(spec, plan)
    if len(names & {"gate_proj", "up_proj"}) == 1:
        have, missing = sorted(names & {"gate_proj", "up_proj"})[0], ({"gate_proj", "up_proj"} - names).pop()
        raise InputError("lora-targets", f"{have} on {spec.model_type} adapts the fused experts' gate_up_proj, "
                         f"which PEFT refuses without {missing}; add {missing}", REFUSED)
    if names and plan.lora_dropout:
        raise InputError("lora-dropout", f"{', '.join(sorted(names))} on {spec.model_type} adapts the router or "
                         "the fused experts through PEFT's ParamWrapper, which refuses lora_dropout > 0; use "
                         "--lora-dropout 0, or name the attention Linears (e.g. q_proj,v_proj)", REFUSED)


def adapter_params(spec: ModelSpec, plan: TrainingPlan) -> list[ParamTensor]:
    """Per layer with experts, the ParamWrappers' lora_A / lora_B (`update_layer`, layer.py:2455-2456): router
    (`gate`) r × h and E × r; gate_up_proj (E × 2i × h, rank 2r) 2rE × h and 2i × 2rE; down_proj (E × h × i,
    rank r) rE × i and h × rE."""
    names = mapped_targets(spec, plan)
    if not names:
        return []
    r = plan.lora_rank
    out = []
    for layer in range(spec.num_layers):
        for p in spec.layer_params(layer):
            m, _, leaf = p.name.rpartition(".")
            if leaf == "gate_up_proj" and len(p.shape) == 3 and {"gate_proj", "up_proj"} <= names:
                e, two_i, h = p.shape
                out += [ParamTensor(f"{m}.base_layer.lora_A.default.weight", (2 * r * e, h), layer),
                        ParamTensor(f"{m}.base_layer.lora_B.default.weight", (two_i, 2 * r * e), layer)]
            elif leaf == "down_proj" and len(p.shape) == 3 and "down_proj" in names:
                e, h, i = p.shape
                out += [ParamTensor(f"{m}.lora_A.default.weight", (r * e, i), layer),
                        ParamTensor(f"{m}.lora_B.default.weight", (h, r * e), layer)]
            elif p.name.endswith(".gate.weight") and len(p.shape) == 2 and "gate" in names:
                e, h = p.shape
                out += [ParamTensor(f"{m}.lora_A.default.weight", (r, h), layer),
                        ParamTensor(f"{m}.lora_B.default.weight", (e, r), layer)]
    return out
