"""The hand-written families' buffers (`llmem.components.buffers`) against the transformers model's own
`named_buffers`, built on the meta device in the dtype the program builds it in (`runtime.model`:
`from_config(dtype=...)`), for every family and the switches that change its buffers."""

import pytest

from llmem.components import buffers
from llmem.components.parameters import parameter_bytes
from llmem.components.trainable import trainable
from llmem.families import FAMILIES
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from tests.test_spec import CASES, TINY

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# partial rotary where the default RoPE reads it (gpt_neox, phi3), odd rotated widths, an explicit head_dim
ROTARY = [("gpt_neox", {"rotary_pct": 0.25}), ("gpt_neox", {"rotary_pct": 0.3}),
          ("phi3", {"partial_rotary_factor": 0.75}), ("phi3", {"head_dim": 10, "partial_rotary_factor": 0.5}),
          ("llama", {"head_dim": 14}), ("falcon", {"hidden_size": 72})]
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "bf16-mixed": torch.float32, "fp16": torch.float16}


def meta_buffer_bytes(config: dict, dtype) -> int:
    cfg = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return sum(b.numel() * b.element_size() for _, b in model.named_buffers())


def test_every_family_is_covered():
    assert {mt for mt, _ in CASES} == set(FAMILIES)


@pytest.mark.parametrize("model_type,extra", CASES + ROTARY,
                         ids=[f"{mt}-{i}" for i, (mt, _) in enumerate(CASES + ROTARY)])
def test_buffers_match_the_meta_model(model_type, extra):
    config = {**TINY, **extra, "model_type": model_type}
    spec = ModelSpec.from_config(config)
    for precision in ("fp32", "bf16") if model_type in ("gemma", "gemma2") else ("fp32",):
        plan = TrainingPlan(precision=precision)
        assert buffers.buffer_bytes(spec, plan) == meta_buffer_bytes(config, PRECISIONS[precision]), precision


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
def test_rope_buffers_stay_fp32_and_embed_scale_follows_the_model(precision):
    """inv_freq is fp32 in every build dtype; Gemma's embed_scale takes the model's dtype (mixed: fp32)."""
    config = {**TINY, "head_dim": 16, "model_type": "gemma"}
    spec = ModelSpec.from_config(config)
    plan = TrainingPlan(precision=precision)
    assert buffers.buffer_bytes(spec, plan) == meta_buffer_bytes(config, PRECISIONS[precision])


def test_buffers_are_whole_on_every_rank():
    """Counted beside each rank's parameter shard once, whole, under DDP, ZeRO-3 and TP (no scheme shards them)."""
    spec = ModelSpec.from_config({**TINY, "model_type": "llama"})
    whole = meta_buffer_bytes({**TINY, "model_type": "llama"}, torch.float32)
    for plan in (TrainingPlan(), TrainingPlan(gpus=2), TrainingPlan(gpus=2, zero=3), TrainingPlan(gpus=2, tp=2)):
        t = trainable(spec, plan)
        assert parameter_bytes(spec, plan) - t.base - t.adapters == whole, plan.scheme
