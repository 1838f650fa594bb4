"""The final norm's backward is a moment of every walk from the lm_head's backward to the last layer's, and on a tiny
vocabulary the measured peak (docs/notes/2026-11-27-final-norm-backward.md). (A pipeline's last stage folds it into
its head term, `walk.pipeline`.)"""

import pytest

from llmem.estimate import estimate
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec

# wide attention, a narrow MLP, a vocabulary a quarter of the hidden size (the accuracy suite's llama-attn)
TINY_VOCAB = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 64, "max_position_embeddings": 1024,
              "tie_word_embeddings": False}
BASE = dict(device="cpu", batch_size=1, seq_len=512, optimizer_impl="forloop")


@pytest.mark.parametrize("plan", [
    dict(), dict(gpus=2), dict(gpus=2, zero=1), dict(gpus=2, zero=3), dict(gpus=2, zero=2, engine="fsdp1"),
    dict(gpus=2, zero=1, engine="deepspeed"), dict(gpus=2, zero=3, engine="deepspeed"), dict(loss="chunked-ce"),
    dict(method="lora"),
], ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()) or "single")
def test_every_walk_has_the_final_norm_moment(plan):
    phases = [ph.name for ph in estimate(ModelSpec.from_config(TINY_VOCAB), TrainingPlan(**{**BASE, **plan})).phases]
    assert any("final norm backward" in name for name in phases), phases


@pytest.mark.heavy  # (the suite's s-llama-attn-final-norm rows measure it too)
def test_a_tiny_vocabulary_peaks_in_the_final_norm_backward_as_measured():
    from llmem.measure.run import measure_rank

    plan = TrainingPlan(**BASE, precision="bf16")
    est = estimate(ModelSpec.from_config(TINY_VOCAB), plan)
    measured = measure_rank(TINY_VOCAB, plan)["peak_bytes"]
    assert est.peak_phase == "final norm backward"
    assert abs(est.peak_bytes - measured) <= 0.01 * measured, (est.peak_bytes, measured)
