"""Mixture-of-experts on the derived path: which expert configs are traced, and what their tables assume.

Routing. transformers 5.23 runs the experts of every model type in `DERIVED_MOE` through `use_experts_implementation`
with its default `grouped_mm` (`modeling_utils.get_correct_experts_implementation`; `integrations/moe.py:
grouped_mm_experts_forward`): the router's top-k has a fixed size, the tokens × top_k rows are sorted by expert
(`sort`, `histc`, `cumsum`) and run as grouped matrix products over all of them, so every tensor of the block has
tokens × top_k rows whichever experts the tokens pick. The fake-tensor trace therefore needs no routing values and
makes no routing assumption, and the memory does not depend on the routing: measured for real per model type, the
model's own routing against every token sent to the same top_k experts, to the byte (tests/derive/
test_moe_routing.py), so `Estimate.peak_bytes_range` is one point. An experts implementation with data-dependent
shapes (the eager loop over `nonzero` experts) is refused (`check_grouped`). `aten._grouped_mm` runs through the
simulation's stand-in (`llmem.simulate.stand_ins.grouped_mm`: its meta function accepts bf16 only).

Layer kinds. The walk counts each decoder layer by its kind (`llmem.derive.kinds`) and each layer's own autocast
weight copies (`autocast.each_layer_copy_bytes`): DeepSeek-V2/V3's and GLM-4-MoE's dense first layers
(`first_k_dense_replace`) and Qwen3-MoE's dense layers among the expert ones (`mlp_only_layers`,
`decoder_sparse_step`) are modelled; under TP a hand-written family's dense layers among the expert ones are refused
naming the field (`LAYER_KIND_FIELDS`).
Model types outside `DERIVED_MOE` are refused: their expert blocks are not checked against real runs (the
hand-written mixtral and qwen2_moe are traced here for their TP program only, `TP_TRACED_MOE`).
Pure Python: no torch (`check_grouped` reads a built model's config).
"""

from __future__ import annotations

from llmem.errors import InputError

EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token", "moe_topk")
LAYER_KIND_FIELDS = ("first_k_dense_replace", "mlp_only_layers", "decoder_sparse_step")
FIELDS = EXPERT_KEYS + TOP_K_KEYS + LAYER_KIND_FIELDS  # what these checks read of a config
# model types whose expert layers are traced, each measured against real CPU runs (tests/derive/test_moe_*.py)
DERIVED_MOE = ("qwen3_moe", "olmoe", "flex_olmo", "granitemoe", "granitemoeshared", "deepseek_v2", "deepseek_v3",
               "glm4_moe", "minimax_m2", "gpt_oss")
# hand-written MoE families whose TP program (transformers' plan) is traced like a derived one (`llmem.derive.tp`):
# their experts run the same `grouped_mm_experts_forward` (measured on 2 ranks, tests/derive/test_tp_moe_lora.py)
TP_TRACED_MOE = ("mixtral", "qwen2_moe")
# Dense and expert decoder layers mixed are traced per layer kind from the model as built (`llmem.derive.kinds`,
# `depth.layer_modules`; autocast's weight copies per layer, `autocast.each_layer_copy_bytes`), measured against
# real CPU runs: DeepSeek-V2/V3 and GLM-4-MoE's `first_k_dense_replace` (tests/derive/test_dense_first.py),
# Qwen3-MoE's `mlp_only_layers` and `decoder_sparse_step` (the suite's qwen3moe-mlponly / qwen3moe-step2 rows);
# no other model type of `DERIVED_MOE` reads these fields (transformers 5.23). Refused: the hand-written families
# traced for their TP program only (`TP_TRACED_MOE`: qwen2_moe's dense layers under TP are not measured).


def _count(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def expert_count(values: dict) -> tuple[str, int] | None:
    """(key, count) of the first expert count above 0 under `EXPERT_KEYS`, else None (a dense config)."""
    return next(((k, _count(values.get(k))) for k in EXPERT_KEYS if _count(values.get(k))), None)


def _layer_kinds(values: dict) -> tuple[str, str, str] | None:
    """(field, why, the value that puts experts in every layer) when a config of a model type outside
    `DERIVED_MOE` mixes dense and expert decoder layers: `first_k_dense_replace` dense layers first, `mlp_only_layers`
    or a `decoder_sparse_step` above 1 (qwen2_moe's `Qwen2MoeDecoderLayer.__init__`)."""
    if values.get("model_type") in DERIVED_MOE:
        return None
    first = _count(values.get("first_k_dense_replace"))
    if first:
        return "first_k_dense_replace", f"the first {first} decoder layers are dense, the others have experts", "0"
    if values.get("mlp_only_layers"):
        return "mlp_only_layers", "the listed decoder layers are dense, the others have experts", "[]"
    step = _count(values.get("decoder_sparse_step"))
    if step > 1:
        return "decoder_sparse_step", f"one decoder layer in {step} has experts, the others are dense", "1"
    return None


def experts_refusal(values: dict, model_type, also: tuple = ()) -> InputError | None:
    """Why a config with expert layers is refused on the derived path (None: dense, or traced): a model type outside
    `DERIVED_MOE` (and `also`: `TP_TRACED_MOE` for a TP spec), or dense and expert layers mixed (one line naming
    the field)."""
    experts = expert_count(values)
    if experts is None:
        return None
    if model_type not in DERIVED_MOE + tuple(also):
        return InputError(experts[0], "mixture-of-experts layers are modelled for mixtral and qwen2_moe and derived "
                          f"for {', '.join(DERIVED_MOE)}; {model_type!r} is derived from transformers, dense layers "
                          "only")
    kinds = _layer_kinds({**values, "model_type": model_type})
    if kinds is not None:
        return InputError(kinds[0], f"mixture-of-experts: {kinds[1]}; layers of different kinds are not modelled "
                          f"for the TP program of {model_type!r} yet (with {kinds[0]} = {kinds[2]} every layer has "
                          "experts)")
    return None


def moe_sizes(values: dict) -> dict:
    """The spec's expert sizes (`ModelSpec.num_experts`, `experts_per_token`: the routing note, the active FLOPs of
    `llmem.checkpointing`); zero for a dense config. The walk reads none of them: the traced tables count the
    expert tensors."""
    experts = expert_count(values)
    if experts is None:
        return {"num_experts": 0, "experts_per_token": 0}
    top_k = next((_count(values.get(k)) for k in TOP_K_KEYS if _count(values.get(k))), 0)
    return {"num_experts": experts[1], "experts_per_token": top_k}


def check_grouped(model, model_type: str) -> None:
    """Expert layers must run `grouped_mm` (shapes independent of the routing); transformers falls back to the
    eager loop over the experts hit (`nonzero`, data-dependent) when grouped_mm cannot dispatch. A model without
    such experts (none made by `use_experts_implementation`) passes."""
    if not any(hasattr(m, "_is_expert_parallel") for m in model.modules()):
        return
    implementation = getattr(model.config, "_experts_implementation", None)
    if implementation not in (None, "grouped_mm"):
        raise InputError("model_type", f"{model_type!r}: transformers runs these experts as {implementation!r}, "
                         "whose tensors depend on the routing; only grouped_mm experts are derived")
