"""Random suite files through `validate`'s loader and estimator (hypothesis): a suite either loads — and then every
row estimates or says why — or is refused with an InputError naming its field, never another exception."""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmem.errors import InputError
from llmem.measure.validate import estimate_row, load_suite

scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 5000), st.floats(allow_nan=True),
                    st.sampled_from(["", "llama", "gpt2", "fp32", "bf16-mixed", "sdpa", "full", "lora", "dim1-if-short",
                                     "x" * 300, "../../etc/passwd", "*a", "&a"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                           max_size=3), max_leaves=6)
TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 64}
models = st.one_of(st.just({"tiny": TINY, "pre": "gpt2"}), values,
                   st.fixed_dictionaries({"tiny": st.one_of(st.just(TINY), values),
                                          "pre": st.sampled_from(["gpt2", "nope", "/etc/hosts", ""])}))
PLAN_VALUES = {"gpus": st.sampled_from([1, 2, 0, "2"]), "zero": st.sampled_from([0, 1, 3, 5]),
               "seq_len": st.sampled_from([16, 64, -1]), "precision": st.sampled_from(["fp32", "bf16-mixed", "fp8"]),
               "method": st.sampled_from(["full", "lora", "qlora"]), "quant": st.sampled_from(["none", "nf4"]),
               "grad_ckpt": st.sampled_from(["none", "full"]), "ckpt_every": st.sampled_from([1, 2]),
               "fsdp_shard": st.sampled_from(["dim0", "dim1-if-short", "dim9"]), "steps": st.sampled_from([1, 0, "x"]),
               }
good_rows = st.fixed_dictionaries({"model": st.sampled_from(["tiny", "pre", 3])},
                                  optional={k: st.one_of(v, v, v, scalars) for k, v in PLAN_VALUES.items()})
rows = st.lists(st.one_of(good_rows, good_rows, good_rows, values), max_size=3)
suites = st.fixed_dictionaries({"rows": rows, "models": models}, optional={ "defaults": st.one_of(st.just({}), values),
                                                          "other": values})


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(suites, values))
def test_random_suites_load_or_name_a_field(tmp_path, document):
    path = tmp_path / "suite.json"
    path.write_text(json.dumps(document, allow_nan=True))
    try:
        suite = load_suite(path)
    except InputError as err:
        assert err.field and " " not in err.field, err
        return
    for row in suite.rows:
        peak, message = estimate_row(row, "cpu")
        assert (peak is None) == bool(message)
        assert peak is None or peak > 0
