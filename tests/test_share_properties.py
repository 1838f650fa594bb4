"""Share links with every individually valid value: decoding always yields inputs that form a plan (a combination
that does not is repaired, with a warning naming the field), and the repaired inputs re-encode to a link that
decodes to themselves without warnings."""

from datetime import timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from llmem.plan import Attention, GradCkpt, Loss, Method, Offload, Optimizer, OptimizerImpl, Precision, Quant
from llmem.share import KEYS, decode, encode

VALUES = {
    "gpus": st.sampled_from(["1", "2", "3", "4", "8", "64"]),
    "tp": st.sampled_from(["1", "2", "4", "8"]),
    "zero": st.sampled_from(["0", "1", "2", "3", "all"]),
    "batch-size": st.sampled_from(["1", "4", "4096"]),
    "seq-len": st.sampled_from(["512", "2048", "8388609"]),
    "precision": st.sampled_from([p.value for p in Precision]),
    "optimizer": st.sampled_from([o.value for o in Optimizer]),
    "optimizer-impl": st.sampled_from([o.value for o in OptimizerImpl]),
    "grad-ckpt": st.sampled_from([g.value for g in GradCkpt]),
    "attn": st.sampled_from([a.value for a in Attention]),
    "offload": st.sampled_from([o.value for o in Offload]),
    "loss": st.sampled_from([x.value for x in Loss]),
    "method": st.sampled_from([m.value for m in Method]),
    "quant": st.sampled_from([q.value for q in Quant]),
    "ckpt-every": st.sampled_from(["1", "2"]),
    "lora-modules-to-save": st.sampled_from(["", "lm_head", "embed_tokens"]),
    "double-quant": st.sampled_from(["true", "false"]),
    "methods": st.sampled_from(["", "lora", "offload-params", "qlora,offload-optimizer"]),
    "fsdp-shard": st.sampled_from(["dim0", "dim1-if-short", "bad"]),
}
links = st.fixed_dictionaries({}, optional=VALUES)


@settings(max_examples=1500, deadline=timedelta(seconds=1), derandomize=True)
@given(links)
def test_every_decoded_link_forms_a_plan(query):
    inputs, warnings = decode(query)
    inputs.to_plan()  # raises InputError if the decoder left an invalid combination
    known = set(KEYS.values())
    assert all(w.split(":", 1)[0] in known or w.startswith("these inputs") for w in warnings), warnings


@settings(max_examples=300, deadline=timedelta(seconds=1), derandomize=True)
@given(links)
def test_repaired_inputs_round_trip_without_warnings(query):
    inputs, _ = decode(query)
    again, warnings = decode(encode(inputs))
    assert not warnings and again == inputs
