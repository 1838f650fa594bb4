"""The trace on fake tensors against the same trace on real CPU tensors: the saved storages (per decoder layer,
before and after the layers) and the live bytes of the last layer's backward, event by event, are the same."""

import contextlib

import pytest
import torch

from llmem.derive.trace import build, trace
from tests.derive.configs import config

CASES = [("olmo2", "float32", None, "sdpa"), ("starcoder2", "float32", "bfloat16", "eager"),
         ("gemma3_text", "bfloat16", None, "sdpa")]


def _real(cfg: dict, dtype: str, attn: str):
    from transformers import AutoModelForCausalLM

    from llmem.plan import TrainingPlan
    from llmem.runtime.model import decoder_layers, hf_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(cfg, TrainingPlan()), dtype=getattr(torch, dtype),
                                             attn_implementation=attn)
    model.train()
    return contextlib.nullcontext(), model, list(decoder_layers(model)), model.get_output_embeddings()


@pytest.mark.parametrize("model_type, dtype, mixed, attn", CASES)
def test_fake_trace_equals_the_real_cpu_trace(model_type, dtype, mixed, attn):
    cfg = config(model_type)
    fake, real = build(cfg, dtype, attn), _real(cfg, dtype, attn)
    for batch, seq in ((1, 12), (2, 40)):  # 40: above gemma3_text's sliding window (an explicit mask)
        f, r = trace(fake, batch, seq, mixed), trace(real, batch, seq, mixed)
        for place in ("outer", "final", "head", "held", "backward"):
            assert [b for _, b in getattr(f, place)] == [b for _, b in getattr(r, place)], place
        assert [[b for _, b in layer] for layer in f.layers] == [[b for _, b in layer] for layer in r.layers]
        assert sum(b for layer in f.layers for _, b in layer) > 0


def test_unsaved_embeddings_output_and_input_ids_under_lora():
    """LoRA on falcon (frozen embeddings): no op of layer 0 saves its input, but `FalconModel.forward` keeps it as
    `inputs_embeds` until it returns (transformers 5.23 `modeling_falcon.py`), so it is alive when the last layer's
    forward starts: tokens × h fp32 bytes; the frozen embedding saves no input_ids, which the step holds all along."""
    from llmem.derive.lora import trace_key
    from llmem.plan import TrainingPlan
    from llmem.sweep.models import SMALL

    plan = TrainingPlan(method="lora", lora_targets="query_key_value", lora_dropout=0.0)
    lora_model = build(SMALL["falcon"], "float32", "eager", lora=trace_key(plan))
    batch, seq, hidden = 2, 16, SMALL["falcon"]["hidden_size"]
    t = trace(lora_model, batch, seq, None)
    assert sum(b for _, b in t.locals) == batch * seq * hidden * 4
    assert ("input_ids (labels)", batch * seq * 8) in t.outer
    full = trace(build(SMALL["falcon"], "float32", "eager"), batch, seq, None)  # layer 0's norm saves its input
    assert sum(b for _, b in full.locals) == 0
