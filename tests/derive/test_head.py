"""The output layer's module name of traced architectures (`llmem.derive.head`) against the model transformers 5.23
builds: GPT-NeoX-Japanese names it `embed_out`, BioGPT `output_projection`; a tied head is a module of its own that the
parameter inventory does not show. `--lora-modules-to-save` then accepts the real name and refuses `lm_head`, which
matches no module (PEFT skips it without a word: no trainable copy in the run), and `all-linear` leaves an untied
head of its own name out, as PEFT does."""

from __future__ import annotations

import pytest

from llmem.components import lora
from llmem.components.lora_head import head_module
from llmem.errors import InputError
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from tests.components.test_lora import peft_model_on_meta

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=512, max_position_embeddings=64)
CASES = [dict(model_type="gpt_neox_japanese", intermediate_multiple_size=2),
         dict(model_type="gpt_neox_japanese", intermediate_multiple_size=2, tie_word_embeddings=False),
         dict(model_type="biogpt", intermediate_size=128), dict(model_type="biogpt", intermediate_size=128,
                                                                tie_word_embeddings=False)]


def _real_head(config: dict) -> str:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    head = model.get_output_embeddings()
    return next(n for n, m in model.named_modules() if m is head)


@pytest.mark.parametrize("extra", CASES, ids=lambda c: f"{c['model_type']}-tied{c.get('tie_word_embeddings', 1)}")
def test_head_module_is_get_output_embeddings(extra):
    config = {**TINY, **extra}
    spec = ModelSpec.from_config(config)
    real = _real_head(config)
    assert spec.derived is not None and head_module(spec) == real
    lora.validate(spec, TrainingPlan(method="lora", lora_targets="all-linear", lora_modules_to_save=real))
    plan = TrainingPlan(method="lora", precision="fp32", lora_rank=8, lora_targets="all-linear")
    trainable, _ = peft_model_on_meta(config, plan).get_nb_trainable_parameters()  # all-linear leaves the head out
    assert lora.trainable_params(spec, plan) == trainable
    if real != "lm_head":
        with pytest.raises(InputError) as err:
            lora.validate(spec, TrainingPlan(method="lora", lora_targets="all-linear", lora_modules_to_save="lm_head"))
        assert err.value.field == "lora-modules-to-save" and real in str(err.value)


@pytest.mark.heavy
def test_tied_head_copy_against_a_real_run():
    """GPT-NeoX-Japanese, tied: `--lora-modules-to-save embed_out` (the head's trainable copy) against the CPU run
    (measured -0.00 %; the copy, its gradient and its Adam states are about a tenth of this peak, so the 1 %
    bound catches it going missing)."""
    from llmem.estimate import estimate
    from llmem.measure.run import measure_rank

    config = {**TINY, **CASES[0]}
    plan = TrainingPlan(device="cpu", optimizer_impl="forloop", batch_size=2, seq_len=64, method="lora",
                        attn="eager", precision="fp32", lora_dropout=0.0, lora_modules_to_save="embed_out")
    measured = measure_rank(config, plan)["peak_bytes"]
    assert abs(estimate(ModelSpec.from_config(config), plan).peak_bytes - measured) / measured < 0.01
