"""`modelled_spec` / `ModelSpec.from_config` and `estimate` over random config dicts of every model_type
transformers knows: a spec and an estimate, or an InputError naming the field. How long a first trace takes is the
benchmarks' concern (scripts/bench_estimate.py), not a timed assertion here: the bare `{"model_type": "opt"}` with
a LoRA plan under FSDP2 mixed precision traces OPT-125m's two PEFT programs at full size (23 s of CPU), which read
217 s on a loaded machine."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmem.errors import InputError
from llmem.estimate import estimate
from llmem.plan import TrainingPlan
from llmem.spec import modelled_spec
from tests.test_cli_properties import MODEL_TYPES, SIZE_KEYS, values

FAMILY_TYPES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "mixtral", "qwen2_moe", "gpt2",
                "opt", "gpt_neox", "falcon", "bloom"]
small = st.integers(0, 96) | values
configs = st.fixed_dictionaries(
    {"model_type": st.sampled_from(MODEL_TYPES) | st.sampled_from(FAMILY_TYPES)},
    optional={k: small for k in SIZE_KEYS},
) | st.none() | st.lists(st.integers(), max_size=2) | st.text(max_size=10)


plans = st.sampled_from([TrainingPlan(seq_len=32), TrainingPlan(seq_len=16, precision="fp16-mixed"),
                         TrainingPlan(gpus=2, zero=3, seq_len=16, method="lora")])


def _estimate_or_named_error(config, plan) -> None:
    try:
        est = estimate(modelled_spec(config), plan)
    except InputError as e:
        assert e.field and " " not in e.field and str(e).count("\n") == 0
    else:
        assert est.peak_bytes > 0 and all(b >= 0 for b in est.breakdown.values())


# No deadline: a fresh example can trace a new config at full size (the first time: seconds to tens of seconds).
# The same examples every run (tests/conftest.py derandomizes): 400 by default (the suite's time budget), 4,000
# under -m heavy.
@settings(max_examples=400, deadline=None)
@given(configs, plans)
def test_random_configs_give_an_estimate_or_a_named_error(config, plan):
    _estimate_or_named_error(config, plan)


@pytest.mark.heavy
@settings(max_examples=4000, deadline=None)
@given(configs, plans)
def test_many_random_configs_give_an_estimate_or_a_named_error(config, plan):
    _estimate_or_named_error(config, plan)
