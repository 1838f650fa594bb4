import pytest
import torch

from llmem.errors import InputError
from llmem.plan import TrainingPlan
from llmem.runtime import build_model, decoder_layers, prepare, train_step
from llmem.runtime.optim import make_optimizer
from tests.measure.conftest import GPT2, LLAMA, MIXTRAL

OPT = {"model_type": "opt", "hidden_size": 32, "ffn_dim": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
       "vocab_size": 128, "max_position_embeddings": 64, "word_embed_proj_dim": 32}


@pytest.mark.parametrize("precision,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16),
                                             ("fp16", torch.float16), ("bf16-mixed", torch.float32)])
def test_built_in_target_dtype(precision, dtype):
    model = build_model(LLAMA, TrainingPlan(device="cpu", precision=precision, attn="eager"))
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert model.config.use_cache is False
    assert model.config._attn_implementation == "eager"
    assert model.training


BIOGPT = {"model_type": "biogpt", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
          "num_attention_heads": 4, "vocab_size": 128, "max_position_embeddings": 64}  # no `_no_split_modules`


@pytest.mark.parametrize("config,n", [(LLAMA, 2), (GPT2, 2), (OPT, 3), (MIXTRAL, 2), (BIOGPT, 3)])
def test_decoder_layers(config, n):
    assert len(decoder_layers(build_model(config, TrainingPlan(device="cpu")))) == n


@pytest.mark.parametrize("impl,foreach,fused", [("forloop", False, False), ("foreach", True, False),
                                                ("fused", False, True), ("default", False, False)])
def test_optimizer_flags_explicit(impl, foreach, fused):
    p = [torch.nn.Parameter(torch.zeros(3))]
    opt = make_optimizer(p, TrainingPlan(device="cpu", optimizer_impl=impl))
    assert opt.defaults["foreach"] is foreach and opt.defaults["fused"] is fused
    sgd = make_optimizer(p, TrainingPlan(device="cpu", optimizer="sgd", optimizer_impl=impl))
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.9


def test_step_trains_and_frees_grads():
    session = prepare(dict(LLAMA), TrainingPlan(device="cpu", batch_size=1, seq_len=8, precision="fp32"))
    before = [p.detach().clone() for p in session.model.parameters()]
    train_step(session)
    assert all(p.grad is None for p in session.model.parameters())
    assert any(not torch.equal(a, p) for a, p in zip(before, session.model.parameters(), strict=True))


def test_bad_model_type_is_input_error():
    with pytest.raises(InputError) as exc:
        build_model({"model_type": "nonesuch"}, TrainingPlan(device="cpu"))
    assert exc.value.field == "model"


def test_world_size_mismatch():
    with pytest.raises(InputError) as exc:
        prepare(dict(LLAMA), TrainingPlan(device="cpu", gpus=2, seq_len=8))
    assert exc.value.field == "gpus"
