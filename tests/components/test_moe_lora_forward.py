"""LoRA on a grouped-experts MoE (mixtral, qwen2_moe): the last layer's forward at its largest inside the routed
experts (`moe_forward.lora_unsaved_bytes`), which the LoRA walks lacked (FSDP2 ZeRO-3 -1.7 %, ZeRO-2 up to -10 %,
one device -1.9 % on the attention-heavy shapes), and under `--cp` the sdpa-backward moment of the MoE layers on
LoRA's table (`query_backward.applies_moe_sdpa`), on which the ring's buffers sit: those plans were a gap.

The default test checks the FSDP2 walk against simulate (the real FSDP2 program on fake tensors, one rank); the
two-rank rows (real torchrun, gloo, CPU) run under -m heavy."""

from __future__ import annotations

import pytest

from llmem.estimate import estimate
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from tests.components.multirank import TwoRankRows

MOMENT = "forward (last layer, MoE experts)"
# wide attention, a narrow MoE block, a small vocabulary (tests/components/test_context_parallel.py's shape)
MIXTRAL = {"model_type": "mixtral", "hidden_size": 256, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 64, "max_position_embeddings": 1024,
           "tie_word_embeddings": False, "num_local_experts": 4, "num_experts_per_tok": 2}
QWEN2_MOE = {"model_type": "qwen2_moe", "hidden_size": 256, "intermediate_size": 64, "moe_intermediate_size": 64,
             "shared_expert_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2,
             "decoder_sparse_step": 1, "num_hidden_layers": 2, "num_attention_heads": 16, "num_key_value_heads": 4,
             "vocab_size": 64, "max_position_embeddings": 1024, "tie_word_embeddings": False}
SMALL = dict(MIXTRAL, hidden_size=128, intermediate_size=32, num_attention_heads=8, num_key_value_heads=2,
             max_position_embeddings=512)
QV, ATTN = "q_proj,v_proj", "q_proj,k_proj,v_proj,o_proj"


def test_fsdp2_lora_forward_in_the_routed_experts_against_simulate():
    """ZeRO-2 (every layer stays gathered through the forward), q, v adapted: the routed experts' forward is the
    peak, alive beside the forward's LoRA saves: `selected_hidden_states_g`, the block input and the embeddings'
    output, which only full fine-tuning's table saves. Within 0.1 % of simulate; the walk's other moments more than
    5 % below it (the walk before: -8.9 % here; measured on 2 ranks, the attention-heavy shape: -10.3 % → -0.015 %)."""
    from llmem.simulate import simulate

    plan = TrainingPlan(device="cpu", gpus=2, zero=2, batch_size=1, seq_len=128, precision="fp32",
                        optimizer_impl="forloop", method="lora", lora_targets=QV)
    est = estimate(ModelSpec.from_config(SMALL), plan)
    sim = simulate(dict(SMALL), plan).peak_bytes
    assert est.peak_phase == MOMENT
    assert abs(est.peak_bytes - sim) <= 0.001 * sim, (est.peak_bytes, sim)
    others = max(ph.total for ph in est.phases if ph.name != MOMENT)
    assert others < 0.95 * sim, (others, sim)


def test_moe_lora_under_cp_is_estimated():
    """The attention-heavy mixtral LoRA plan under --cp 2 (a gap before: no sdpa moment for the ring's bound) is
    estimated; its peak is the routed experts' forward (measured 12,704,456 B, estimated 12,704,368)."""
    plan = TrainingPlan(gpus=2, zero=3, cp=2, batch_size=1, seq_len=512, precision="fp32", optimizer_impl="forloop",
                        method="lora", lora_targets=QV)
    est = estimate(ModelSpec.from_config(MIXTRAL), plan)
    assert est.peak_phase == MOMENT
    assert any("ring attention backward" in ph.name for ph in est.phases)


def test_one_gpu_adapted_shared_expert_gate_against_a_real_run():
    """qwen2_moe's shared_expert_gate runs after the routed experts: an adapted gate's saves are not made at the
    moment (`moe_forward.lora_not_yet_bytes`; counting them read +4.8 % here, leaving the moment out -0.32 %).
    bf16-mixed, one GPU, 1 x 256: within 0.1 % of a real CPU run (counting allocator)."""
    from llmem.measure.run import measure_rank

    plan = TrainingPlan(device="cpu", batch_size=1, seq_len=256, precision="bf16-mixed", optimizer_impl="forloop",
                        method="lora", lora_targets="shared_expert_gate")
    est = estimate(ModelSpec.from_config(QWEN2_MOE), plan)
    assert est.peak_phase == MOMENT
    real = measure_rank(dict(QWEN2_MOE), plan)["peak_bytes"]
    assert abs(est.peak_bytes - real) <= 0.001 * real, (est.peak_bytes, real)


BASE = {"gpus": 2, "precision": "fp32", "optimizer_impl": "forloop", "method": "lora", "lora_targets": QV,
        "batch_size": 1, "seq_len": 256}
ROWS = {  # (estimate - measured) / measured, before -> after, measured on 2 ranks
    "mixtral-qv-zero3": {"zero": 3},  # -1.69 % -> -0.017 %
    "mixtral-attn-zero2-bf16mix-2x64": {"zero": 2, "lora_targets": ATTN, "precision": "bf16-mixed",
                                        "batch_size": 2, "seq_len": 64},  # -8.84 % -> -0.008 %
    "qwen2_moe-qv-zero2-bf16mix": {"zero": 2, "precision": "bf16-mixed"},  # -6.58 % -> -0.022 %
    "qwen2_moe-attn-zero3": {"zero": 3, "lora_targets": ATTN},  # -0.101 % -> -0.013 %
    # --cp 2 (gaps before): the experts' forward, the ring in a checkpointed layer's recompute
    "mixtral-qv-zero3-cp2-1x512": {"zero": 3, "cp": 2, "seq_len": 512},  # -0.001 %
    "qwen2_moe-qv-zero3-cp2-ckpt-2x64": {"zero": 3, "cp": 2, "grad_ckpt": "full", "batch_size": 2,
                                         "seq_len": 64},  # +0.002 %
}


def _config(name: str) -> dict:
    return dict(MIXTRAL if name.startswith("mixtral") else QWEN2_MOE)


RUNS = TwoRankRows(BASE, ROWS, _config, sampled=())


@pytest.mark.parametrize("name", RUNS.params())
def test_two_ranks_within_1_percent(name):
    RUNS.check(name, tolerance=0.01)
