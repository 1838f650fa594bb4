"""Every option of the table has its widget in the app, and the LoRA alpha and dropout widgets the app gained reach
the link and the estimate."""

import pytest
from streamlit.testing.v1 import AppTest

from llmem.options import CHECK, NUMBER, SELECT, TEXT
from llmem.widgets import TABLE_WIDGETS

from .conftest import APP

QUERY = {"model": "llama-3.2-1b-instruct", "gpus": "1", "zero": "0", "seq-len": "4096", "method": "lora"}


def run(query: dict) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params.update(query)
    return at.run()


def widget(at: AppTest, option):
    get = {SELECT: at.selectbox, NUMBER: at.number_input, TEXT: at.text_input, CHECK: at.checkbox}[option.widget.kind]
    return get(key=option.widget.key)


def peak(at: AppTest) -> float:
    return at.table[0].value["per-GPU peak (GiB)"].iloc[0]


def test_every_option_of_the_table_has_its_widget_and_label():
    at = run(QUERY)
    assert not at.exception
    for option in TABLE_WIDGETS:
        assert widget(at, option).label == option.widget.label


def test_lora_dropout_zero_lowers_the_peak_and_travels_in_the_link():
    """PEFT's LoRA layer with lora_dropout=0 uses nn.Identity (peft 0.21.2 tuners/lora/layer.py:255): no dropout
    output or mask is kept for backward, so the peak falls; the 0.05 default keeps one per adapted Linear."""
    at = run(QUERY)
    assert not at.exception and "lora-dropout" not in at.query_params
    dropout = at.number_input(key="w_lora_dropout")
    assert dropout.value == pytest.approx(0.05) and not dropout.disabled
    before = peak(at)
    dropout.set_value(0.0).run()
    assert not at.exception
    assert at.query_params["lora-dropout"] == "0.0"
    assert peak(at) < before
    reopened = run(dict(at.query_params))
    assert reopened.number_input(key="w_lora_dropout").value == 0.0 and peak(reopened) == peak(at)


def test_lora_alpha_travels_in_the_link_and_leaves_memory_alone():
    at = run(QUERY)
    before = peak(at)
    at.number_input(key="w_lora_alpha").set_value(64).run()
    assert not at.exception
    assert at.query_params["lora-alpha"] == "64" and peak(at) == before  # alpha only scales the adapter's output
    full = run({**QUERY, "method": "full", "lora-alpha": "64"})
    assert full.number_input(key="w_lora_alpha").disabled and full.number_input(key="w_lora_dropout").disabled


def test_a_link_past_a_widget_bound_opens_with_a_warning_not_an_error():
    """Streamlit's number_input raises on a value above its maximum: a link may not put one there."""
    at = run({**QUERY, "lora-dropout": "0.995", "lora-alpha": "99999999"})
    assert not at.exception
    warned = [w.value.replace("\\", "") for w in at.warning if w.value.startswith("Share link")]
    assert any("lora-dropout" in w for w in warned) and any("lora-alpha" in w for w in warned)
    assert at.number_input(key="w_lora_dropout").value == pytest.approx(0.05)


def test_engine_fsdp1_reaches_the_strategies_the_link_and_the_estimate():
    """A link with engine=fsdp1 selects the widget, stays in the link, and every strategy row is FSDP1's, with the
    library's FSDP1 estimate; without it the same link shows FSDP2's rows."""
    query = {"model": "llama-3.2-1b-instruct", "gpus": "2", "zero": "3", "seq-len": "4096", "engine": "fsdp1",
             "precision": "bf16-mixed"}
    at = run(query)
    assert not at.exception
    assert at.selectbox(key="w_engine").value == "fsdp1" and at.query_params["engine"] == "fsdp1"
    table = at.table[0].value
    assert list(table.index) == ["ZeRO-0 (FSDP1 NO_SHARD)", "ZeRO-2 (FSDP1 SHARD_GRAD_OP)",
                                 "ZeRO-3 (FSDP1 FULL_SHARD)"]
    from llmem.estimate import estimate
    from llmem.plan import TrainingPlan
    from llmem.presets import load_preset
    from llmem.spec import modelled_spec

    spec = modelled_spec(load_preset("llama-3.2-1b-instruct"))
    plan = TrainingPlan(gpus=2, zero=3, seq_len=4096, engine="fsdp1", precision="bf16-mixed")
    shown = table["per-GPU peak (GiB)"].loc["ZeRO-3 (FSDP1 FULL_SHARD)"]
    assert shown == pytest.approx(estimate(spec, plan).peak_bytes / 2**30, abs=0.006)
    torch_engine = run({k: v for k, v in query.items() if k != "engine"})
    assert not any("FSDP1" in s for s in torch_engine.table[0].value.index)


def test_no_sync_is_greyed_out_on_one_gpu_and_a_link_setting_it_there_is_repaired():
    """`--no-sync` needs 2+ GPUs (`Needs("gpus", at_least=2)`): on one GPU its checkbox is disabled, and a link
    setting it there opens with the default and a warning instead of the plan's refusal."""
    one = run({**QUERY, "method": "full", "grad-accum": "2"})
    assert not one.exception and one.checkbox(key="w_no_sync").disabled
    two = run({**QUERY, "method": "full", "gpus": "2", "grad-accum": "2"})
    assert not two.exception and not two.checkbox(key="w_no_sync").disabled
    linked = run({**QUERY, "method": "full", "grad-accum": "2", "no-sync": "1"})
    assert not linked.exception and not linked.error
    warned = [w.value.replace("\\", "") for w in linked.warning if w.value.startswith("Share link")]
    assert any("no-sync" in w for w in warned) and "no-sync" not in linked.query_params
