"""`modelled_spec` / `ModelSpec.from_config` and `estimate` over random config dicts of every model_type
transformers knows: a spec and an estimate, or an InputError naming the field — within a second each (a traced LoRA
model: ten)."""

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from llmem.errors import InputError
from llmem.estimate import estimate
from llmem.plan import TrainingPlan
from llmem.spec import modelled_spec
from tests.test_cli_properties import MODEL_TYPES, SIZE_KEYS, values

# A traced LoRA plan under FSDP2 mixed precision traces two PEFT programs (fp32 and half adapters): 12 s for bloom
# with the whole suite running on two cores. The bound catches a hang or a blow-up, not a slow machine.
TRACE_SECONDS = 30.0
FAMILY_TYPES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "mixtral", "qwen2_moe", "gpt2",
                "opt", "gpt_neox", "falcon", "bloom"]
small = st.integers(0, 96) | values
configs = st.fixed_dictionaries(
    {"model_type": st.sampled_from(MODEL_TYPES) | st.sampled_from(FAMILY_TYPES)},
    optional={k: small for k in SIZE_KEYS},
) | st.none() | st.lists(st.integers(), max_size=2) | st.text(max_size=10)


@settings(max_examples=2000)  # (the suite's time budget: fresh examples trace new configs)
@given(configs, st.sampled_from([TrainingPlan(seq_len=32), TrainingPlan(seq_len=16, precision="fp16-mixed"),
                                 TrainingPlan(gpus=2, zero=3, seq_len=16, method="lora")]))
def test_random_configs_give_an_estimate_or_a_named_error(config, plan):
    t0 = time.perf_counter()
    try:
        est = estimate(modelled_spec(config), plan)
    except InputError as e:
        assert e.field and " " not in e.field and str(e).count("\n") == 0
    else:
        assert est.peak_bytes > 0 and all(b >= 0 for b in est.breakdown.values())
    # a LoRA plan on a family without a hand-written LoRA table traces the PEFT model on fake tensors the first time
    # (a second or two on an idle machine, kept per spec after that); anything else is a table lookup and a walk
    assert time.perf_counter() - t0 < (TRACE_SECONDS if plan.method.value != "full" else 1.0)
