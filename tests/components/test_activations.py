"""Independent-measurement accuracy: the estimator's single-rank peak against a real CPU run (allocator trace).

Tiny configs with unequal dimensions (heads·head_dim ≠ hidden where allowed, kv heads ≠ heads, intermediate not a
multiple of hidden) so that terms cannot alias. Dropout is off in CONFIGS; DROPOUT keeps the families' own dropout
defaults (gpt2 0.1 everywhere, opt 0.1 on the residual branches) and switches it on for attention elsewhere.
"""

from __future__ import annotations

import pytest

from llmem.estimate import estimate
from llmem.measure.timeline import timeline
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec

_LLAMA = dict(vocab_size=1000, hidden_size=192, intermediate_size=400, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=2, head_dim=40, max_position_embeddings=512)
CONFIGS = {
    "llama": dict(model_type="llama", **_LLAMA),
    "qwen3": dict(model_type="qwen3", **_LLAMA),
    "gemma": dict(model_type="gemma", **_LLAMA),
    "phi3": dict(model_type="phi3", vocab_size=1000, hidden_size=192, intermediate_size=400, num_hidden_layers=2,
                 num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, **_LLAMA),
    "qwen2_moe": dict(model_type="qwen2_moe", vocab_size=1000, hidden_size=192, intermediate_size=400,
                      num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=144, shared_expert_intermediate_size=272,
                      max_position_embeddings=512),
    "gpt2": dict(model_type="gpt2", vocab_size=1000, n_embd=192, n_inner=400, n_layer=2, n_head=6, n_positions=256,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "opt": dict(model_type="opt", vocab_size=1000, hidden_size=192, ffn_dim=400, num_hidden_layers=2,
                num_attention_heads=6, max_position_embeddings=256, word_embed_proj_dim=160, dropout=0.0),
    "gpt_neox": dict(model_type="gpt_neox", vocab_size=1000, hidden_size=192, intermediate_size=400,
                     num_hidden_layers=2, num_attention_heads=6, rotary_pct=0.25, max_position_embeddings=256),
    "falcon": dict(model_type="falcon", vocab_size=1000, hidden_size=192, ffn_hidden_size=400, num_hidden_layers=2,
                   num_attention_heads=6, num_kv_heads=2, new_decoder_architecture=True, parallel_attn=True,
                   bias=False),
    "falcon_mq": dict(model_type="falcon", vocab_size=1000, hidden_size=192, num_hidden_layers=2,
                      num_attention_heads=6, multi_query=True, parallel_attn=True, new_decoder_architecture=False,
                      bias=False),
}
CONFIGS["gemma2"] = dict(model_type="gemma2", sliding_window=32, **_LLAMA)  # eager only in transformers 5.23
CONFIGS["bloom"] = dict(model_type="bloom", vocab_size=1000, hidden_size=192, n_layer=2, n_head=6)  # eager only
EAGER_ONLY = ("gemma2", "bloom")
_NO_DROP = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout")
DROPOUT = {
    "gpt2": {k: v for k, v in CONFIGS["gpt2"].items() if k not in _NO_DROP},
    "opt": {k: v for k, v in CONFIGS["opt"].items() if k not in _NO_DROP},
    "llama": dict(CONFIGS["llama"], attention_dropout=0.1),
    "gpt_neox": dict(CONFIGS["gpt_neox"], attention_dropout=0.1, hidden_dropout=0.1),
}


def _error(cfg: dict, **plan) -> float:
    p = TrainingPlan(device="cpu", optimizer_impl="forloop", **plan)
    measured = timeline(cfg, p).peak_bytes
    return (estimate(ModelSpec.from_config(cfg), p).peak_bytes - measured) / measured


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_fp32_peak_within_2_percent(family):
    attn = "eager" if family in EAGER_ONLY else "sdpa"
    assert abs(_error(CONFIGS[family], batch_size=4, seq_len=64, precision="fp32", attn=attn)) < 0.02


@pytest.mark.parametrize("family", ["llama", "gpt2", "mixtral", "qwen2_moe", "gemma2"])
def test_bf16_mixed_peak_within_2_percent(family):
    attn = "eager" if family in EAGER_ONLY else "sdpa"
    assert abs(_error(CONFIGS[family], batch_size=2, seq_len=64, precision="bf16-mixed", attn=attn)) < 0.02


def test_gemma2_softcapping_in_compute_dtype():
    """Eager attention dominates at 512 tokens: gemma2's softcapping tanh output is saved in the scores' dtype
    (bf16 under autocast), not fp32 (a 2× overcount of it was +10% here, +2.8% for gemma-2-2b at 2048 tokens)."""
    assert abs(_error(CONFIGS["gemma2"], batch_size=1, seq_len=512, precision="bf16-mixed", attn="eager")) < 0.005


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_checkpointed_peak_within_2_percent(family):
    assert abs(_error(CONFIGS[family], batch_size=2, seq_len=64, precision="fp32", grad_ckpt="full")) < 0.02


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3", "opt", "gpt2", "gpt_neox", "falcon"])
def test_eager_peak_within_2_percent(family):
    assert abs(_error(CONFIGS[family], batch_size=2, seq_len=64, precision="fp32", attn="eager")) < 0.02


@pytest.mark.parametrize(("family", "attn", "precision"), [
    ("gpt2", "sdpa", "fp32"), ("gpt2", "eager", "bf16-mixed"), ("opt", "eager", "fp32"), ("opt", "sdpa", "bf16"),
    ("llama", "sdpa", "fp32"), ("llama", "eager", "bf16-mixed"), ("gpt_neox", "sdpa", "fp32"),
])
def test_dropout_peak_within_2_percent(family, attn, precision):
    """CPU dropout keeps a noise tensor in the input's dtype; sdpa with dropout falls back to the fp32 math path."""
    assert abs(_error(DROPOUT[family], batch_size=2, seq_len=64, precision=precision, attn=attn)) < 0.02


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_mlp_output_dropout_is_freed_before_the_layer_backward_peak(attn):
    """gpt2's dropout on the MLP output is the first node of a layer's backward: its noise is released before the
    MLP's backward peak. Counting it there put this checkpointed run 0.6 % high; the peak is a layer-backward moment,
    so the term is what this test weighs. Without it: sdpa +0.61 %, eager +0.40 %; with it: sdpa -0.005 %, eager
    +0.21 % (eager's remaining bytes are another term, below this tolerance)."""
    plan = dict(batch_size=2, seq_len=64, precision="fp32", grad_ckpt="full", attn=attn)
    est = estimate(ModelSpec.from_config(DROPOUT["gpt2"]), TrainingPlan(device="cpu", optimizer_impl="forloop", **plan))
    assert est.peak_phase.startswith("backward (")
    assert abs(_error(DROPOUT["gpt2"], **plan)) < {"sdpa": 0.001, "eager": 0.003}[attn]
