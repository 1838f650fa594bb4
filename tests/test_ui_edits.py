"""llmem.ui.edits: the fixes one widget change applies to the others, where a message goes, the sidebar's groups."""

from llmem.options import LINK_OPTIONS, SPECIAL
from llmem.plan import TrainingPlan
from llmem.ui import edits
from llmem.widgets import TABLE_WIDGETS


def state(**values) -> dict:
    base = {"w_method": "full", "w_quant": "none", "w_precision": "bf16-mixed", "w_gpus": 1, "w_strategy": "all",
            "w_offload": "none", "w_loss": "standard"}
    return base | values


def test_qlora_gets_its_base_and_its_compute_dtype_and_the_result_is_a_valid_plan():
    s = state(w_method="qlora", w_precision="fp16-mixed")
    notes = edits.on_edit(s, "w_method")
    assert s["w_quant"] == "nf4" and s["w_precision"] == "fp16" and len(notes) == 2
    TrainingPlan(method=s["w_method"], quant=s["w_quant"], precision=s["w_precision"])  # no InputError


def test_qlora_with_an_int8_base_on_several_gpus_goes_to_nf4_and_lora_leaves_tensor_parallelism():
    s = state(w_method="qlora", w_quant="int8", w_precision="bf16", w_gpus=2)
    assert edits.on_edit(s, "w_method") and s["w_quant"] == "nf4"
    s = state(w_method="lora", w_gpus=8, w_strategy="2:3")
    assert edits.on_edit(s, "w_method") and s["w_strategy"] == "all"


def test_full_clears_the_base_and_a_valid_choice_needs_no_note():
    s = state(w_quant="nf4")
    assert edits.on_edit(s, "w_method") == [] and s["w_quant"] == "none"
    assert edits.on_edit(state(w_precision="bf16"), "w_precision") == []


def test_offload_and_fused_loss_under_compare_all_pick_one_strategy():
    s = state(w_gpus=8, w_offload="optimizer+params")
    assert edits.on_edit(s, "w_offload") and s["w_strategy"] == "1:3"
    s = state(w_gpus=8, w_loss="fused-linear-ce")
    assert edits.on_edit(s, "w_loss") and s["w_strategy"] == "1:1"
    s = state(w_gpus=8, w_offload="optimizer")  # the single-GPU offload on 8 GPUs: its FSDP2 form
    edits.on_edit(s, "w_gpus")
    assert s["w_offload"] == "optimizer+params" and s["w_strategy"] == "1:3"
    s = state(w_gpus=1, w_offload="optimizer+params", w_strategy="1:3")
    edits.on_edit(s, "w_gpus")
    assert s["w_offload"] == "optimizer"


def test_messages_use_the_widgets_names_and_go_under_their_widget():
    assert edits.app_words("use --precision bf16 or --zero 3") == "use “Precision” bf16 or “Strategy” 3"
    assert edits.app_words("--no-such-flag stays") == "--no-such-flag stays"
    assert edits.widget_for("precision") == "w_precision" and edits.widget_for("tp") == "w_strategy"
    assert edits.widget_for("hidden_size") == "w_source"  # a config.json field: under the model


def test_every_widget_is_in_exactly_one_group():
    names = [n for _, group in edits.GROUPS for n in group]
    assert len(names) == len(set(names))
    for option in TABLE_WIDGETS:
        assert option.name in names, option.name
    specials = {o.name for o in LINK_OPTIONS if o.widget and o.widget.kind == SPECIAL}
    assert specials - {"tp"} <= set(names)  # tp and zero share the strategy widget, listed as zero
    assert edits.group_of("zero") == edits.group_of("gpus") == "Hardware"


def test_an_invalid_strategy_falls_back_to_compare_all_with_a_note():
    s = state(w_gpus=3, w_strategy="2:3")
    assert "compare all" in edits.strategy_or_all(s, {"1:0": "DDP"}) and s["w_strategy"] == "all"
    s = state(w_strategy="1:0")
    assert edits.strategy_or_all(s, {"1:0": "DDP"}) == "" and s["w_strategy"] == "1:0"


def test_offload_or_the_fused_loss_on_a_strategy_they_do_not_run_on_move_to_one_they_do():
    s = state(w_gpus=8, w_strategy="1:0", w_offload="optimizer+params")
    assert edits.on_edit(s, "w_offload") and s["w_strategy"] == "1:3"
    s = state(w_gpus=8, w_strategy="1:2", w_offload="optimizer+params")
    assert edits.on_edit(s, "w_offload") == [] and s["w_strategy"] == "1:2"  # ZeRO-2 runs it: kept
    s = state(w_gpus=8, w_strategy="2:3", w_loss="fused-linear-ce")
    assert edits.on_edit(s, "w_loss") and s["w_strategy"] == "1:1"
    s = state(w_gpus=8, w_strategy="1:0", w_loss="fused-linear-ce")
    assert edits.on_edit(s, "w_loss") == [] and s["w_strategy"] == "1:0"


def test_a_chosen_strategy_wins_over_the_offload_or_loss_it_does_not_run():
    s = state(w_gpus=8, w_strategy="1:0", w_offload="optimizer+params")
    assert edits.on_edit(s, "w_strategy") and s["w_strategy"] == "1:0" and s["w_offload"] == "none"
    s = state(w_gpus=8, w_strategy="1:3", w_loss="fused-linear-ce")
    assert edits.on_edit(s, "w_strategy") and s["w_strategy"] == "1:3" and s["w_loss"] == "standard"
    s = state(w_gpus=8, w_strategy="all", w_offload="optimizer+params")  # compare all chosen: offload goes
    assert edits.on_edit(s, "w_strategy") and s["w_strategy"] == "all" and s["w_offload"] == "none"
