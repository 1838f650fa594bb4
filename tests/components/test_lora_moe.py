"""LoRA on the grouped-experts MoE families (mixtral, qwen2_moe) with the MoE block frozen: adapters on the attention
Linears, the experts, router and shared expert without weight gradients (`lora_activations.frozen_moe_dropped`,
`lora_moe.frozen_moe_backward_moments`), and QLoRA's 4-bit attention Linears on top. The estimate against a real
CPU run (counting allocator), within 1 %.
Routing does not change these peaks (`test_moe_routing`: every tensor of the block has tokens × top_k rows).
Before the frozen block was modelled (the full-fine-tuning MoE table and the dense LoRA backward) these rows missed
by -5.7 % to +2.6 %; the gathered tokens and the down mm input, saved only for expert weight gradients, are what
separate the two."""

from __future__ import annotations

import pytest

from llmem.errors import InputError
from llmem.estimate import estimate
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from tests.components.test_activations import CONFIGS

CASES = [
    ("mixtral", "q_proj,v_proj", "fp32", "none", 0.0),
    ("mixtral", "q_proj,v_proj", "bf16", "none", 0.0),
    ("mixtral", "q_proj,v_proj", "bf16-mixed", "none", 0.0),
    ("mixtral", "q_proj,v_proj", "fp32", "full", 0.0),
    ("mixtral", "q_proj,v_proj", "bf16", "full", 0.0),
    ("mixtral", "q_proj,k_proj,v_proj,o_proj", "bf16-mixed", "full", 0.1),
    ("qwen2_moe", "q_proj,v_proj", "fp32", "none", 0.0),
    ("qwen2_moe", "q_proj,v_proj", "bf16", "none", 0.0),
    ("qwen2_moe", "q_proj,v_proj", "bf16-mixed", "none", 0.0),
    ("qwen2_moe", "q_proj,v_proj", "fp32", "full", 0.0),
    ("qwen2_moe", "q_proj,v_proj", "bf16", "full", 0.0),
    ("qwen2_moe", "q_proj,k_proj,v_proj,o_proj", "fp32", "none", 0.1),
    # -0.6 % while the recompute's peak amid the routed part's locals was not modelled (`_shared_recompute_locals`)
    ("qwen2_moe", "q_proj,v_proj", "bf16-mixed", "full", 0.0),
]
OTHER = [  # with other options of the LoRA walk
    ("mixtral", dict(lora_modules_to_save="lm_head")), ("qwen2_moe", dict(loss="chunked-ce")),
    ("mixtral", dict(grad_accum=2, grad_ckpt="full")), ("qwen2_moe", dict(grad_ckpt="full", ckpt_every=2)),
]


# all-linear: on qwen2_moe PEFT adapts the attention Linears, the shared expert's gate/up/down_proj and its
# shared_expert_gate (the router and the fused experts are not nn.Linear); on mixtral the attention Linears, the
# router and both fused expert stacks (ParamWrapper, `lora_experts`), whose materialised stacks dominate
ALL_LINEAR = [  # measured (estimate - measured): qwen2_moe fp32 +0.006 %, bf16 +0.008 %, bf16-mixed +0.14 % (not
    # checkpointed); -0.003 %, -0.005 %, 0.000 % (checkpointed); mixtral -0.001 %, +0.004 %, +0.03 %; -0.001 %,
    # -0.002 %, -0.02 %
    ("qwen2_moe", "all-linear", "fp32", "none", 0.0),
    ("qwen2_moe", "all-linear", "bf16", "none", 0.0),
    ("qwen2_moe", "all-linear", "bf16-mixed", "none", 0.0),
    ("qwen2_moe", "all-linear", "fp32", "full", 0.0),
    ("qwen2_moe", "all-linear", "bf16", "full", 0.0),  # +0.66 % before `_shared_gate_adapter_bytes`
    ("qwen2_moe", "all-linear", "bf16-mixed", "full", 0.0),
    ("qwen2_moe", "all-linear", "fp32", "none", 0.1),
    ("qwen2_moe", "all-linear", "bf16", "full", 0.05),  # -0.73 % before the shared gate adapter's recompute step
    ("mixtral", "all-linear", "fp32", "none", 0.0),
    ("mixtral", "all-linear", "bf16", "none", 0.0),
    ("mixtral", "all-linear", "bf16-mixed", "none", 0.0),
    ("mixtral", "all-linear", "fp32", "full", 0.0),
    ("mixtral", "all-linear", "bf16", "full", 0.0),
    ("mixtral", "all-linear", "bf16-mixed", "full", 0.0),
]
ALL_LINEAR_OTHER = [  # all-linear with other options of the LoRA walk (3 layers)
    ("mixtral", dict(grad_ckpt="full", ckpt_every=2)), ("mixtral", dict(lora_modules_to_save="lm_head")),
    ("qwen2_moe", dict(grad_ckpt="full", ckpt_every=2)), ("qwen2_moe", dict(loss="chunked-ce")),
]

QLORA = [  # the attention Linears in 4 bits (the experts are not Linears; qwen2_moe's shared expert is)
    ("mixtral", "q_proj,v_proj", "bf16", "none", 0.0, "nf4"),
    ("mixtral", "q_proj,v_proj", "fp32", "full", 0.0, "nf4"),  # +0.46 %
    ("qwen2_moe", "q_proj,v_proj", "bf16", "full", 0.0, "fp4"),
    ("qwen2_moe", "q_proj,v_proj", "fp16", "none", 0.0, "nf4"),
    ("qwen2_moe", "all-linear", "bf16", "none", 0.0, "nf4"),  # the shared expert's Linears in 4 bits too: +0.006 %
    ("qwen2_moe", "all-linear", "fp32", "full", 0.0, "nf4"),  # +0.08 %
    ("mixtral", "all-linear", "bf16", "none", 0.0, "nf4"),  # the router and experts adapted, not quantized: +0.002 %
    ("mixtral", "all-linear", "fp32", "full", 0.0, "nf4"),  # +0.26 % (as the attention-only row, +0.46 %)
]


def _plan(targets: str, precision: str, ckpt: str, dropout: float, quant: str = "none") -> TrainingPlan:
    method = "lora" if quant == "none" else "qlora"
    return TrainingPlan(device="cpu", optimizer_impl="forloop", batch_size=2, seq_len=64, method=method, quant=quant,
                        lora_targets=targets, lora_dropout=dropout, precision=precision, grad_ckpt=ckpt)


@pytest.mark.parametrize("family,targets,precision,ckpt,dropout,quant",
                         [(*c, "none") for c in CASES + ALL_LINEAR] + QLORA)
def test_frozen_moe_block_peak_within_1_percent(family, targets, precision, ckpt, dropout, quant):
    pytest.importorskip("torch")
    from llmem.measure.counting import CountingTracker
    from llmem.measure.run import measure_rank

    plan = _plan(targets, precision, ckpt, dropout, quant)
    measured = measure_rank(CONFIGS[family], plan, tracker=CountingTracker())["peak_bytes"]
    estimated = estimate(ModelSpec.from_config(CONFIGS[family]), plan).peak_bytes
    assert abs(estimated - measured) / measured < 0.01


@pytest.mark.parametrize("family,options", OTHER + [(f, dict(o, lora_targets="all-linear", lora_dropout=0.0))
                                                    for f, o in ALL_LINEAR_OTHER])
def test_with_other_options_within_1_percent(family, options):
    pytest.importorskip("torch")
    from llmem.measure.counting import CountingTracker
    from llmem.measure.run import measure_rank

    cfg = dict(CONFIGS[family], num_hidden_layers=3)
    options = dict(dict(lora_targets="q_proj,v_proj", lora_dropout=0.0), **options)
    plan = TrainingPlan(device="cpu", optimizer_impl="forloop", batch_size=2, seq_len=64, method="lora",
                        precision="fp32", **options)
    measured = measure_rank(cfg, plan, tracker=CountingTracker())["peak_bytes"]
    assert abs(estimate(ModelSpec.from_config(cfg), plan).peak_bytes - measured) / measured < 0.01


@pytest.mark.parametrize("precision", ["fp32", "fp16-mixed"])
def test_mixtral_recompute_holds_the_forward_locals(precision):
    """Seed 12's s12-1115 (mixtral LoRA q/v, fp32, checkpointed, ZeRO-1: -1.50 %): a checkpointed layer's recompute
    stops at the un-permuting index's save (first thought: the routing-weight mul's) with the block input and the
    gathered tokens still alive as locals (the frozen router and experts save neither) and the RNG state's copy; just
    before, at the down grouped mm, the unsaved `silu(gate) * up` is alive too. fp32 with SGD (so the layer's peak is
    the step's): -1.81 % before, the fp16-mixed twin +0.04 % either way (its peak is elsewhere). Bound 1 % as the rows
    above."""
    from llmem.measure.run import measure_rank
    from llmem.sweep.models import SMALL

    plan = TrainingPlan(device="cpu", optimizer="sgd", batch_size=2, seq_len=64, method="lora", lora_dropout=0.0,
                        lora_targets="q_proj,v_proj", precision=precision, grad_ckpt="full")
    measured = measure_rank(SMALL["mixtral"], plan)["peak_bytes"]
    estimated = estimate(ModelSpec.from_config(SMALL["mixtral"]), plan).peak_bytes
    print(f"{precision}: estimate {estimated:,} measured {measured:,} ({(estimated - measured) / measured:+.3%})")
    assert abs(estimated - measured) / measured < 0.01


@pytest.mark.parametrize("family,targets,ckpt", [
    ("qwen2_moe", "q_proj,shared_expert_gate", "full"),  # checkpointed, fp32, dropout 0: +1.0 %, not pinned down
    ("qwen2_moe", "down_proj,shared_expert_gate", "full"),
    ("mixtral", "q_proj,gate", "none"),  # transformers-4 names PEFT maps onto the router and the fused experts
    ("mixtral", "w1,w3", "none"),
])
def test_part_of_the_moe_block_is_a_gap_naming_the_field(family, targets, ckpt):
    with pytest.raises(InputError) as err:
        estimate(ModelSpec.from_config(CONFIGS[family]), _plan(targets, "fp32", ckpt, 0.0))
    assert err.value.field == "lora-targets" and err.value.gap


SHARED_EXPERT = [  # (targets, precision, ckpt, dropout, optimizer); -2.35 % for the first before layer 0 was right
    ("gate_proj,up_proj,down_proj", "fp32", "none", 0.0, "adamw"),
    ("gate_proj,up_proj,down_proj", "bf16-mixed", "none", 0.0, "adamw"),
    ("gate_proj,up_proj,down_proj", "fp32", "full", 0.0, "sgd"),
    ("up_proj,down_proj,shared_expert_gate", "bf16-mixed", "none", 0.05, "adamw"),
    ("q_proj,shared_expert_gate", "fp32", "none", 0.0, "adamw"),
    ("gate_proj,up_proj", "bf16", "full", 0.05, "adamw"),
    # an adapted shared_expert_gate without gate_proj/up_proj, checkpointed (fp32 with dropout 0 stays a gap, +1.0 %):
    # fp32 dropout 0.05 / 0.1 -0.003 % / -0.002 %, bf16-mixed dropout 0 / 0.05 +0.001 % / +0.002 %, bf16 -0.003 %
    ("shared_expert_gate", "fp32", "full", 0.05, "sgd"),
    ("shared_expert_gate", "bf16-mixed", "full", 0.0, "sgd"),
    ("q_proj,shared_expert_gate", "bf16-mixed", "full", 0.0, "adamw"),
    ("down_proj,shared_expert_gate", "bf16", "full", 0.0, "adamw"),
    ("shared_expert_gate", "bf16", "full", 0.05, "adamw"),
]


@pytest.mark.parametrize("targets,precision,ckpt,dropout,optimizer",
                         [SHARED_EXPERT[0]] + [pytest.param(*c, marks=pytest.mark.heavy) for c in SHARED_EXPERT[1:]])
def test_qwen2_moe_shared_expert_adapters_within_1_percent(targets, precision, ckpt, dropout, optimizer):
    """MLP names on qwen2_moe adapt the shared expert only (its Linears; the routed experts are not Linears). Without
    attention adapters layer 0's attention and routed experts save nothing, and the shared expert saves what its
    adapted Linears' outputs need (`lora_moe.SHARED_EXPERT_NEEDS`). Against a real CPU run, 1 % as the rows above."""
    pytest.importorskip("torch")
    from llmem.measure.counting import CountingTracker
    from llmem.measure.run import measure_rank

    plan = TrainingPlan(device="cpu", optimizer_impl="forloop", batch_size=2, seq_len=64, method="lora",
                        lora_targets=targets, lora_dropout=dropout, precision=precision, grad_ckpt=ckpt,
                        optimizer=optimizer)
    measured = measure_rank(CONFIGS["qwen2_moe"], plan, tracker=CountingTracker())["peak_bytes"]
    estimated = estimate(ModelSpec.from_config(CONFIGS["qwen2_moe"]), plan).peak_bytes
    assert abs(estimated - measured) / measured < 0.01, f"estimate {estimated:,} measured {measured:,}"


def test_mixtral_all_linear_with_dropout_is_refused_as_peft_refuses_it():
    with pytest.raises(InputError) as err:  # ParamWrapper raises on lora_dropout != 0
        estimate(ModelSpec.from_config(CONFIGS["mixtral"]), _plan("all-linear", "fp32", "none", 0.1))
    assert err.value.field == "lora-dropout"


def test_mixtral_all_linear_adapter_count_is_peft_s():
    """lora_A/lora_B of the router (r), gate_up_proj (rank 2r per expert) and down_proj (r per expert), counted as
    PEFT 0.21 builds them on transformers 5.23 (fixed here from a build of the tiny config: r = 8, E = 4, h = 192,
    i = 400; attention 4 × 8 × (192 + 240 | 80 | 80 | 240 + 192) per layer)."""
    from llmem.components.lora import trainable_params

    plan = TrainingPlan(method="lora", lora_targets="all-linear", lora_rank=8, lora_dropout=0.0)
    per_layer = 8 * (192 + 240) + 8 * (192 + 80) * 2 + 8 * (240 + 192) + 8 * (192 + 4) + 64 * (192 + 800) \
        + 32 * (400 + 192)
    assert trainable_params(ModelSpec.from_config(CONFIGS["mixtral"]), plan) == 2 * per_layer


@pytest.mark.parametrize("dense", [dict(mlp_only_layers=[1]), dict(decoder_sparse_step=2)])
def test_dense_layers_among_the_expert_layers_are_a_gap(dense):
    with pytest.raises(InputError) as err:
        estimate(ModelSpec.from_config(dict(CONFIGS["qwen2_moe"], **dense)), _plan("q_proj,v_proj", "fp32", "none", 0))
    assert err.value.field == "mlp_only_layers" and err.value.gap


@pytest.mark.parametrize("field,plan", [("zero", dict(gpus=2, zero=1, method="qlora", quant="nf4", precision="bf16"))])
def test_unmeasured_plans_are_a_gap(field, plan):
    plan = TrainingPlan(**{"method": "lora", "lora_targets": "q_proj,v_proj", **plan})
    with pytest.raises(InputError) as err:
        estimate(ModelSpec.from_config(CONFIGS["qwen2_moe"]), plan)
    assert err.value.field == field and err.value.gap


def test_qlora_with_the_8_bit_base_is_a_gap():  # measured +3.2 % on mixtral bf16, not pinned down
    plan = TrainingPlan(method="qlora", quant="int8", precision="bf16", lora_targets="q_proj,v_proj")
    with pytest.raises(InputError) as err:
        estimate(ModelSpec.from_config(CONFIGS["mixtral"]), plan)
    assert err.value.field == "quant" and err.value.gap


def test_mixtral_checkpointed_recompute_stops_at_the_unpermuting_index():
    """A checkpointed mixtral layer's recompute stops where the un-permuting index packs `inv_perm`, so it has run
    `inv_perm[perm] = torch.arange(r)` with both int64 tensors alive (`lora_moe._unpermute_stop_bytes`, r × 16 B);
    the walk stopped at the routing-weight mul before: -0.068 % here (4,096 B short), the attention-heavy grid's
    checkpointed rows -0.05 … -0.12 %. fp32 (no half gemm scratch); left: ~104 B (8 B per adapter per layer and
    more), so the bound 0.02 % sits between the two."""
    from llmem.measure.run import measure_rank
    from tests.components.test_moe_lora_forward import MIXTRAL

    plan = TrainingPlan(device="cpu", batch_size=2, seq_len=64, method="lora", lora_targets="q_proj,v_proj",
                        precision="fp32", grad_ckpt="full")
    measured = measure_rank(MIXTRAL, plan)["peak_bytes"]
    est = estimate(ModelSpec.from_config(MIXTRAL), plan)
    assert est.peak_phase == "backward (last layer)"
    assert abs(est.peak_bytes - measured) / measured < 0.0002, f"estimate {est.peak_bytes:,} measured {measured:,}"
