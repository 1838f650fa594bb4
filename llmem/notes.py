"""Plain-language notes on an estimate: facts about the plan a reader would not guess from the breakdown."""

from __future__ import annotations

import math

from llmem.components.sharding import FSDP_SCHEMES, fsdp_shard_dim, fsdp_shard_numel, tp_local_shape
from llmem.plan import Engine, Method, TrainingPlan
from llmem.spec import ModelSpec

PADDING_NOTE_FRACTION = 0.05  # say it when padding adds at least 5% to the gathered parameters


def fsdp_padding_note(spec: ModelSpec, plan: TrainingPlan) -> str | None:
    """FSDP2 chunks every tensor on dim 0 over the data-parallel ranks and pads it to ceil(d0 / dp) rows
    (`FSDPParam._init_sharded_param`, torch/distributed/fsdp/_fully_shard/_fsdp_param.py), so a tensor whose dim 0
    is smaller than the rank count (stacked experts: num_experts rows) is stored at 1/d0 of its size per rank, not
    1/dp, and all-gathered dp/d0 times its size. Returns a note naming those tensors and the fix, or None."""
    if plan.scheme not in FSDP_SCHEMES or plan.dp == 1 or plan.engine is Engine.FSDP1:  # FSDP1 pads the flat end
        return None
    shapes = [tp_local_shape(p, plan.tp) for p in spec.params]
    exact = sum(math.prod(s) for s in shapes)
    gathered = sum(fsdp_shard_numel(s, plan) * plan.dp for s in shapes)
    if exact == 0 or gathered - exact < PADDING_NOTE_FRACTION * exact:
        return None
    short = [(p, s) for p, s in zip(spec.params, shapes, strict=True)
             if s and s[0] < plan.dp and not fsdp_shard_dim(s, plan)]
    if not short:
        return None
    worst_p, worst_s = max(short, key=lambda ps: fsdp_shard_numel(ps[1], plan) * plan.dp - math.prod(ps[1]))
    factor = fsdp_shard_numel(worst_s, plan) * plan.dp / math.prod(worst_s)
    return (f"FSDP2 pads dim 0 of each tensor to a multiple of the {plan.dp} data-parallel GPUs: {len(short)} "
            f"tensors have fewer rows than that (e.g. {worst_p.name}, {worst_s[0]} rows), so each GPU stores 1/"
            f"{worst_s[0]} of them instead of 1/{plan.dp} and gathers them {factor:.1f}× their size; the padding "
            f"adds {(gathered - exact) / exact:.0%} to the gathered parameters. Fix: --fsdp-shard dim1-if-short "
            f"(fully_shard(shard_placement_fn=...) returning Shard(1) for them, where dim 1 divides evenly), "
            f"or use at most "
            f"{min(s[0] for _, s in short)} GPUs per shard group (HSDP) — compare fewer GPUs to see the gain.")


def moe_routing_note(spec: ModelSpec, plan: TrainingPlan) -> str | None:
    """Mixture-of-experts: the estimate assumes nothing about routing, because nothing depends on it —
    `integrations/moe.py: grouped_mm_experts_forward` (transformers 5.23) sorts the tokens × top_k rows by expert
    and runs grouped matmuls over all of them, so every tensor of the layer has the same size whichever experts the
    tokens go to (tests/components/test_moe_routing.py, and tests/derive/test_moe_routing.py for the derived model
    types: every token to the same experts and the model's own routing measure the same peak to the byte)."""
    if not spec.is_moe:
        return None
    return (f"Mixture of experts: each token goes to {spec.experts_per_token} of {spec.num_experts} experts, and "
            "transformers runs them as grouped matrix products over all tokens × top-k rows, so the peak is the "
            "same however the router spreads the tokens (balanced or all to the same experts): the range is this "
            "one figure.")


def qlora_experts_note(spec: ModelSpec, plan: TrainingPlan) -> str | None:
    """QLoRA on a mixture of experts: transformers' bitsandbytes replacement converts `nn.Linear` modules only
    (transformers 5.23 `integrations/bitsandbytes.py:189`, `replace_with_bnb_linear`), and the experts are fused 3-D
    parameters of one module, so they stay in the load dtype, frozen (docs/MODEL-QLORA-MOE.md); on a large MoE they
    are most of the base."""
    from llmem.components.quant import quantized_weights

    if not spec.is_moe or plan.method is not Method.QLORA:
        return None
    quantized = {p.name for p in quantized_weights(spec, plan)}
    experts = sum(p.numel for p in spec.params if ".experts." in p.name and p.name not in quantized)
    if not experts:
        return None
    return (f"QLoRA quantizes the nn.Linear modules only (transformers' replace_with_bnb_linear): the fused experts' "
            f"{experts / 1e9:.2f} B parameters ({experts / spec.total_params:.0%} of the model) are not Linears and "
            f"stay in {plan.precision.torch_dtype_name}, frozen, {experts * plan.precision.param_bytes / 2**30:.2f} "
            "GiB; the attention Linears and any shared expert's Linears are quantized.")


def reserved_order_note(spec: ModelSpec, plan: TrainingPlan) -> str | None:
    """FSDP2 on CUDA with default segments, when the root's reduce-scatter input is larger than every segment the
    build left (`reserved.oversize_bytes` > 0): the reserved high end (a category sum) cannot see the order effects
    that make the caching allocator cut that segment again in iteration 2 and give the fp32 log-softmax tensors
    segments of their own — `simulate`'s replay reads 10–14 % above it on llama-3.1-8b ZeRO-3 and TP × FSDP2
    (docs/notes/2026-11-27-reserved-agreement.md); with expandable segments the rules agree within 2.1 %. Not
    where the high end replays the program's own requests (`request_stream.replays`: within 0.4 % of simulate on
    the 13 FSDP2 rows, docs/notes/2026-11-27-fsdp2-request-stream.md)."""
    from llmem.components import request_stream, reserved
    from llmem.plan import AllocConf, Device

    if (plan.scheme not in FSDP_SCHEMES or plan.engine is not Engine.TORCH or plan.device is not Device.CUDA
            or plan.alloc_conf is not AllocConf.DEFAULT or not reserved.oversize_bytes(spec, plan)
            or request_stream.replays(spec, plan)):
        return None
    return ("Reserved memory under FSDP2 with default allocator segments: the high end can read low here (the "
            "root's reduce-scatter input is larger than any cached segment, and the order of later requests can "
            "make the allocator reserve it twice; simulate reads up to 14 % above the high end on Llama-3.1-8B). "
            "Check with `llmem simulate`, or plan with --alloc-conf expandable-segments (modelled within 2.1 %).")


def plan_notes(spec: ModelSpec, plan: TrainingPlan) -> tuple[str, ...]:
    """Every note that applies to this plan, in a stable order."""
    notes = (fsdp_padding_note(spec, plan), moe_routing_note(spec, plan), qlora_experts_note(spec, plan),
             reserved_order_note(spec, plan))
    return tuple(n for n in notes if n)


def table_notes(spec: ModelSpec, plans) -> tuple[str, ...]:
    """The notes of a strategy table, each once: FSDP2's padding note only for the strategy with the most
    data-parallel GPUs (its TP × FSDP2 rows pad the same tensors over fewer), the others as the rows give them."""
    plans = list(plans)
    padded = [p for p in plans if fsdp_padding_note(spec, p)]
    notes = [fsdp_padding_note(spec, max(padded, key=lambda p: p.dp))] if padded else []
    for p in plans:
        notes += [moe_routing_note(spec, p), qlora_experts_note(spec, p), reserved_order_note(spec, p)]
    return tuple(dict.fromkeys(n for n in notes if n))
