"""`--attn sdpa` on a derived architecture follows transformers' own choice when no attention is forced."""

import pytest
import torch
import transformers

from llmem.choices import Attention
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec, attention_implementation
from tests.derive.configs import config


def _transformers_default(model_type: str) -> str:
    """The attention transformers picks when none is asked for, read from a model it builds on the meta device."""
    cfg = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in config(model_type).items()
                                                           if k != "model_type"})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return model.config._attn_implementation


@pytest.mark.parametrize("model_type", ["gpt_oss", "qwen3_moe"])
def test_default_attention_is_what_transformers_runs(model_type, tmp_path, monkeypatch):
    monkeypatch.setenv("LLMEM_CACHE_DIR", str(tmp_path))
    assert attention_implementation(model_type, Attention.SDPA) == _transformers_default(model_type)
    assert attention_implementation(model_type, Attention.EAGER) == "eager"


@pytest.mark.heavy
def test_gpt_oss_default_view_gives_an_estimate():
    """gpt_oss has no sdpa path (`_supports_sdpa = False`): the default plan was refused ('use --attn eager')."""
    from llmem.estimate import estimate

    spec = ModelSpec.from_config(config("gpt_oss"))
    default = estimate(spec, TrainingPlan(seq_len=64))
    assert default.peak_bytes == estimate(spec, TrainingPlan(seq_len=64, attn="eager")).peak_bytes > 0


def test_reading_the_class_prints_nothing(tmp_path):
    """Reading `_supports_sdpa` imports the modeling module, whose first import loads the quantizers' libraries
    (torchao logs each CUDA extension a CPU-only machine cannot load): quieted, as the trace is."""
    import os
    import subprocess
    import sys

    code = "from llmem.derive.attention import supports_sdpa; print(supports_sdpa('smollm3'))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "LLMEM_CACHE_DIR": str(tmp_path)})
    assert run.returncode == 0 and run.stdout.strip() == "True" and run.stderr == "", run.stderr[-2000:]
