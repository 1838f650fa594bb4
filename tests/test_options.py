"""Each row of the options table reaches every front-end: a value off its default given on the command line reaches
the plan, in a link round-trips without a warning, and through the app's widgets comes back unchanged. The values
are written here, so a new row fails these tests until it has one."""

import pytest

from llmem.cli import build_parser, plan_from_args
from llmem.options import LINK_OPTIONS, OPTIONS, PLAN_OPTIONS
from llmem.share import decode, encode
from llmem.widgets import TABLE_WIDGETS, inputs_from_state, state_from_inputs

# option -> (its text on the command line and in a link, the other options it needs, as text)
SAMPLES = {
    "gpus": ("8", {}), "tp": ("2", {"gpus": "2"}), "zero": ("3", {"gpus": "2"}), "batch_size": ("4", {}),
    "seq_len": ("512", {}), "precision": ("bf16", {}), "optimizer": ("sgd", {}), "optimizer_impl": ("fused", {}),
    "grad_ckpt": ("full", {}), "ckpt_every": ("2", {"grad_ckpt": "full"}), "attn": ("eager", {}),
    "device": ("cpu", {}), "method": ("lora", {}), "lora_rank": ("8", {"method": "lora"}),
    "lora_alpha": ("64", {"method": "lora"}), "lora_dropout": ("0.1", {"method": "lora"}),
    "lora_targets": ("q_proj,v_proj", {"method": "lora"}), "lora_modules_to_save": ("lm_head", {"method": "lora"}),
    "lora_adapter_dtype": ("base", {"method": "lora", "precision": "bf16"}),
    "quant": ("int8", {"method": "qlora", "precision": "bf16"}),
    "double_quant": ("true", {"method": "qlora", "quant": "nf4", "precision": "bf16"}), "grad_accum": ("4", {}),
    "offload": ("optimizer", {}), "loss": ("fused-linear-ce", {}),
    "fsdp_shard": ("dim1-if-short", {"gpus": "2", "zero": "3"}),
    "ddp_bucket_view": ("true", {"gpus": "2"}),
    "keep_grads": ("true", {}),
    "no_sync": ("true", {"gpus": "2", "zero": "3", "grad_accum": "2"}),
    "float8": ("rowwise", {"precision": "bf16"}),
    "alloc_conf": ("expandable-segments", {}),
    "engine": ("fsdp1", {"gpus": "2", "zero": "3"}),
    "fsdp1_wrap": ("adapters", {"engine": "fsdp1", "gpus": "2", "zero": "3", "method": "lora", "precision": "fp32"}),
    "loss_chunks": ("4", {"loss": "chunked-ce"}),
    "optimizer_in_backward": ("true", {}),
    "activation_offload": ("true", {"grad_ckpt": "full"}),
    "pp": ("2", {"gpus": "2", "microbatches": "2", "batch_size": "2"}),
    "pp_schedule": ("gpipe", {"pp": "2", "gpus": "2"}),
    "pp_stages_per_rank": ("3", {"pp": "2", "gpus": "2", "pp_schedule": "interleaved-1f1b", "microbatches": "2",
                                 "batch_size": "2"}),
    "microbatches": ("4", {"pp": "2", "gpus": "2", "batch_size": "4"}),
    "cp": ("2", {"gpus": "2", "zero": "3"}),
    "ds_reduce_bucket": ("1000000", {"engine": "deepspeed", "gpus": "2", "zero": "2"}),
    "ds_overlap_comm": ("true", {"engine": "deepspeed", "gpus": "2", "zero": "2"}),
    "ds_prefetch_bucket": ("1000000", {"engine": "deepspeed", "gpus": "2", "zero": "3"}),
    "ds_persistence_threshold": ("1280", {"engine": "deepspeed", "gpus": "2", "zero": "3"}),
}
APP_ONLY = {"model": "gpt2", "gpu_type": "h100-sxm", "upload": "my-config.json", "methods": "lora,qlora"}


def _shown(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def test_every_plan_option_has_a_sample():
    assert set(SAMPLES) == {o.name for o in PLAN_OPTIONS}


@pytest.mark.parametrize("option", PLAN_OPTIONS, ids=lambda o: o.name)
def test_a_value_on_the_command_line_reaches_the_plan(option):
    text, context = SAMPLES[option.name]
    argv = ["estimate", "--model", "gpt2"]
    for name, value in {**context, option.name: text}.items():
        flag = f"--{name.replace('_', '-')}"
        argv += [flag] if value == "true" else [flag, value]
    plan = plan_from_args(build_parser().parse_args(argv))
    assert _shown(getattr(plan, option.name)) == text
    assert _shown(getattr(plan_from_args(build_parser().parse_args(argv[:3])), option.name)) != text


@pytest.mark.parametrize("option", LINK_OPTIONS, ids=lambda o: o.name)
def test_a_value_in_a_link_round_trips_without_warnings(option):
    text, context = SAMPLES.get(option.name, (APP_ONLY.get(option.name), {}))
    query = {k.replace("_", "-"): v for k, v in {**context, option.name: text}.items()}
    inputs, warnings = decode(query)
    assert warnings == []
    assert _shown(getattr(inputs, option.name)) == text
    assert encode(inputs)[option.key] == text
    assert decode(encode(inputs)) == (inputs, [])


@pytest.mark.parametrize("option", TABLE_WIDGETS, ids=lambda o: o.name)
def test_a_value_from_a_link_comes_back_through_the_widgets(option):
    text, context = SAMPLES[option.name]
    inputs, _ = decode({k.replace("_", "-"): v for k, v in {**context, option.name: text, "gpu_type": "l4"}.items()})
    state = state_from_inputs(inputs)
    assert inputs_from_state(state, inputs.model, inputs.upload) == inputs


def test_every_option_has_help_and_a_unique_key():
    assert all(len(o.help) > 20 for o in OPTIONS)
    assert len({o.key for o in OPTIONS}) == len(OPTIONS)


def test_every_widget_names_its_sidebar_group():
    """The app draws each option where its row says (`Widget.group`): a widget without a group is one another row's
    widget already draws (tp and zero share the strategy box)."""
    from llmem.options import GROUP_TITLES

    grouped = {o.widget.key for o in OPTIONS if o.widget and o.widget.group}
    for option in OPTIONS:
        if option.widget:
            assert option.widget.group in (*GROUP_TITLES, "") and option.widget.key in grouped, option.name


@pytest.mark.parametrize("value,held", [(1, False), (2, True), ("2", True), ("1", False), ("", False), ("x", False)])
def test_a_need_of_at_least_reads_numbers_and_their_text(value, held):
    """`Needs(at_least=...)` (no-sync's 2+ GPUs) reads the typed value a plan holds and the text a widget or link
    gives; anything not a whole number does not meet it."""
    from llmem.options import BY_NAME

    assert BY_NAME["no_sync"].needs.holds(value) is held
