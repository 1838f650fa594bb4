"""Routing does not change a grouped-experts MoE step's peak: transformers 5.23 runs the experts as grouped matmuls
over all tokens × top_k rows (`integrations/moe.py: grouped_mm_experts_forward`), so every tensor of the layer has
tokens × top_k rows whichever experts they go to. Measured on CPU, two real steps each: the model's own routing
(random init: tokens spread over the experts) against every token sent to the same top_k experts (the router's
indices overwritten in place after its forward, through `.data` so autograd sees the same tensor). The estimate's
`peak_bytes_range` is therefore one point for these models (`llmem.estimate`), and this test is what says so."""

import pytest
import torch

from llmem.measure.counting import CountingTracker
from llmem.measure.run import measure_rank
from llmem.plan import TrainingPlan

MODELS = {
    "mixtral": {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
                "vocab_size": 512, "max_position_embeddings": 256},
    "qwen2_moe": {"model_type": "qwen2_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 48,
                  "shared_expert_intermediate_size": 96, "num_experts": 4, "num_experts_per_tok": 2,
                  "decoder_sparse_step": 1, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256},
}


def _same_experts(hit: set):
    def install(session, mark):
        def route(module, args, out):
            indices = out[2]
            indices.data.copy_(torch.arange(indices.shape[1]).expand_as(indices))

        for m in session.model.modules():
            if type(m).__name__.endswith("TopKRouter"):
                m.register_forward_hook(route)
            elif type(m).__name__.endswith("Experts"):
                m.register_forward_pre_hook(lambda mod, args: hit.update(args[1].unique().tolist()))
    return install


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_peak_does_not_depend_on_routing(model, precision):
    plan = TrainingPlan(batch_size=2, seq_len=64, precision=precision, device="cpu")
    spread = measure_rank(MODELS[model], plan, tracker=CountingTracker())["peak_bytes"]
    hit: set = set()
    skewed = measure_rank(MODELS[model], plan, tracker=CountingTracker(), mark_hook=_same_experts(hit))["peak_bytes"]
    assert hit == {0, 1}  # every token went to experts 0 and 1
    assert skewed == spread
