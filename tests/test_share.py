"""Inputs <-> URL query string: round trips, tampered links and path refusal; decode never raises."""

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmem.errors import InputError
from llmem.gpus import list_gpus
from llmem.plan import Attention, GradCkpt, Loss, Method, Offload, Optimizer, OptimizerImpl, Precision, Quant
from llmem.share import ALL, KEYS, AppInputs, check_model_name, decode, encode


def test_encode_uses_cli_option_names_and_every_input():
    query = encode(AppInputs(model="meta-llama/Llama-3.1-8B", gpu_type="h100-sxm", gpus=8, tp=2, zero=3,
                             batch_size=4, seq_len=4096, precision=Precision.BF16, grad_ckpt=GradCkpt.FULL))
    assert query == {
        "model": "meta-llama/Llama-3.1-8B", "gpu-type": "h100-sxm", "gpus": "8", "tp": "2", "zero": "3",
        "batch-size": "4", "seq-len": "4096", "precision": "bf16", "optimizer": "adamw",
        "optimizer-impl": "default", "grad-ckpt": "full", "attn": "sdpa", "quant": "none", "offload": "none",
        "loss": "standard",
    }
    assert all(isinstance(v, str) for v in query.values())


def test_round_trip_without_warnings():
    inputs = AppInputs(model="qwen2.5-0.5b", gpu_type="l4", gpus=4, zero=1, batch_size=2, seq_len=1024,
                       optimizer=Optimizer.SGD, optimizer_impl=OptimizerImpl.FUSED, attn=Attention.EAGER)
    assert decode(encode(inputs)) == (inputs, [])
    assert decode({}) == (AppInputs(), [])


def test_missing_values_take_the_defaults_given():
    defaults = AppInputs(model="gpt2", gpus=2)
    inputs, warnings = decode({"batch-size": "8"}, defaults)
    assert inputs == defaults.with_(batch_size=8) and warnings == []


@pytest.mark.parametrize("query, field", [
    ({"gpus": "-3"}, "gpus"), ({"gpus": "1e9"}, "gpus"), ({"gpus": "99999"}, "gpus"),
    ({"batch-size": "0"}, "batch-size"), ({"seq-len": "abc"}, "seq-len"), ({"zero": "7"}, "zero"),
    ({"precision": "int3"}, "precision"), ({"gpu-type": "tpu"}, "gpu-type"), ({"attn": "flash"}, "attn"),
    ({"optimizer": "lion"}, "optimizer"), ({"grad-ckpt": "some"}, "grad-ckpt"), ({"colour": "red"}, "colour"),
    ({"quant": "nf3"}, "quant"),
])
def test_tampered_values_warn_naming_the_field_and_the_default(query, field):
    inputs, warnings = decode(query)
    assert inputs == AppInputs()
    assert len(warnings) == 1 and field in warnings[0]
    if field != "colour":
        assert warnings[0].startswith(f"{field}:") and "using" in warnings[0]


@pytest.mark.parametrize("optimizer", ["adafactor", "adamw8bit", "paged-adamw8bit"])
def test_memory_saving_optimizers_round_trip_and_repair(optimizer):
    inputs = AppInputs(model="qwen2.5-0.5b", gpus=2, zero=1, optimizer=Optimizer(optimizer))
    assert decode(encode(inputs)) == (inputs, [])
    inputs, warnings = decode({"optimizer": optimizer, "gpus": "4", "zero": "3"})
    assert inputs.optimizer is Optimizer.ADAMW and warnings[0].startswith("optimizer:")
    inputs.to_plan()
    inputs, warnings = decode({"optimizer": optimizer, "optimizer-impl": "fused"})
    assert inputs.optimizer_impl is OptimizerImpl.DEFAULT and warnings[0].startswith("optimizer-impl:")
    inputs.to_plan()


def test_invalid_combinations_are_repaired_with_a_warning():
    inputs, warnings = decode({"gpus": "1", "zero": "3"})
    assert (inputs.gpus, inputs.zero) == (1, 0) and any(w.startswith("zero:") for w in warnings)
    inputs, warnings = decode({"gpus": "6", "tp": "4", "zero": "0"})
    assert (inputs.tp, inputs.zero) == (1, 0) and any(w.startswith("tp:") for w in warnings)
    inputs, warnings = decode({"gpus": "8", "tp": "2", "zero": "1"})
    assert (inputs.tp, inputs.zero) == (2, 3) and any(w.startswith("zero:") for w in warnings)
    inputs, warnings = decode({"batch-size": "4096", "seq-len": "1000000"})
    assert inputs.batch_size == 1 and any(w.startswith("batch-size:") for w in warnings)
    inputs.to_plan()


@pytest.mark.parametrize("value", [
    "/etc/passwd", "~/secrets", "../config.json", "./config.json", ".hidden", "a/b/c", "org/../x",
    "config.json", "C:\\model", "org\\name", "presets/llama/config.yaml", "x" * 300, "", "   ",
    "org/name?x=1", "org//name", "name with space",
])
def test_model_values_that_could_name_a_file_are_refused(value):
    with pytest.raises(InputError) as err:
        check_model_name(value)
    assert err.value.field == "model"
    inputs, warnings = decode({"model": value})
    assert inputs.model == AppInputs().model and warnings and warnings[0].startswith("model:")


def test_a_name_that_exists_on_disk_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mymodel").mkdir()
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").mkdir()
    for value in ("mymodel", "org/name"):
        with pytest.raises(InputError, match="file path"):
            check_model_name(value)
    assert check_model_name("org/other") == "org/other"
    assert os.getcwd() == str(tmp_path)


@pytest.mark.parametrize("value", ["llama-3.1-8b", "meta-llama/Llama-3.1-8B", "Qwen/Qwen2.5-0.5B", "gpt2"])
def test_preset_names_and_hub_ids_are_accepted(value):
    assert check_model_name(value) == value


def test_upload_travels_only_as_a_sanitised_display_name():
    inputs, warnings = decode({"upload": "my<script>config.json"})
    assert inputs.upload == "my_script_config.json" and warnings == []
    assert encode(inputs)["upload"] == inputs.upload
    assert "upload" not in encode(AppInputs())


def test_repeated_keys_take_the_last_value():
    inputs, _ = decode({"gpus": ["2", "4"]})
    assert inputs.gpus == 4


_keys = st.one_of(st.sampled_from(sorted(KEYS.values())), st.text(max_size=12))
_values = st.one_of(
    st.text(max_size=40),
    st.integers(-10, 10**7).map(str),
    st.sampled_from([ALL, "bf16", "fp16-mixed", "a100-80gb", "h100", "sgd", "fused", "full", "eager", "../x", "/"]),
)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(_keys, _values, max_size=14))
def test_decode_never_raises_and_is_idempotent(query):
    inputs, warnings = decode(query)
    assert isinstance(inputs, AppInputs) and all(isinstance(w, str) for w in warnings)
    inputs.to_plan()  # always a valid plan
    check_model_name(inputs.model)
    assert decode(encode(inputs)) == (inputs, [])


@settings(max_examples=200, deadline=None)
@given(
    gpu=st.sampled_from([g.key for g in list_gpus()]),
    gpus=st.sampled_from([1, 2, 4, 8, 16, 64]),
    batch=st.integers(1, 64), seq=st.integers(1, 32768),
    precision=st.sampled_from(list(Precision)), ckpt=st.sampled_from(list(GradCkpt)),
    data=st.data(),
)
def test_valid_inputs_round_trip_exactly(gpu, gpus, batch, seq, precision, ckpt, data):
    tp = 1 if ckpt is GradCkpt.SELECTIVE else data.draw(st.sampled_from([t for t in (1, 2, 4, 8) if gpus % t == 0]))
    zeros = [ALL] + ([0] if gpus == 1 or tp == gpus else [3] if tp > 1 else [0, 1, 2, 3])
    zero = data.draw(st.sampled_from(zeros))
    inputs = AppInputs(gpu_type=gpu, gpus=gpus, tp=tp, zero=zero, batch_size=batch, seq_len=seq,
                       precision=precision, grad_ckpt=ckpt)
    assert decode(encode(inputs)) == (inputs, [])


def test_quant_round_trips_and_selects_qlora():
    inputs = AppInputs(model="llama-2-7b", gpus=1, zero=0, precision=Precision.BF16, quant=Quant.FP4)
    assert decode(encode(inputs)) == (inputs, [])
    plan = inputs.to_plan()
    assert (plan.method, plan.quant) == (Method.QLORA, Quant.FP4)
    assert AppInputs().to_plan().method is Method.FULL


@pytest.mark.parametrize("query", [
    {"quant": "int8"},  # default precision bf16-mixed: an 8-bit base under autocast is not modelled
    {"quant": "nf4", "precision": "bf16", "gpus": "4", "tp": "2", "zero": "3"},  # qlora: no TP
    {"quant": "int8", "precision": "bf16", "gpus": "2", "zero": "3"},  # FSDP2 drops the 8-bit weight's CB/SCB
])
def test_tampered_quant_combinations_fall_back_to_none_with_a_warning(query):
    inputs, warnings = decode(query)
    assert inputs.quant is Quant.NONE
    assert any(w.startswith("quant:") for w in warnings)
    inputs.to_plan()  # a valid plan


def test_ckpt_every_round_trips_and_tampered_values_warn():
    inputs = AppInputs(model="qwen2.5-0.5b", grad_ckpt=GradCkpt.FULL, ckpt_every=3)
    assert encode(inputs)["ckpt-every"] == "3" and "ckpt-every" not in encode(AppInputs())
    assert decode(encode(inputs)) == (inputs, [])
    assert inputs.to_plan().ckpt_every == 3
    for bad in ("0", "-2", "x", "99999"):
        got, warnings = decode({"grad-ckpt": "full", "ckpt-every": bad})
        assert got.ckpt_every == 1 and len(warnings) == 1 and warnings[0].startswith("ckpt-every:")
    got, warnings = decode({"ckpt-every": "4"})  # without grad-ckpt full it has no meaning
    assert got.ckpt_every == 1 and any(w.startswith("ckpt-every:") for w in warnings)


def test_offload_and_loss_round_trip_and_tampering_warns():
    inputs = AppInputs(gpus=4, zero=3, offload=Offload.OPTIMIZER_PARAMS)
    assert decode(encode(inputs)) == (inputs, [])
    fused = AppInputs(gpus=1, zero=0, loss=Loss.FUSED_LINEAR_CE)
    assert decode(encode(fused)) == (fused, [])
    for query, field in (({"offload": "nvme"}, "offload"), ({"loss": "<script>"}, "loss")):
        decoded, warnings = decode(query)
        assert decoded == AppInputs() and len(warnings) == 1 and warnings[0].startswith(field + ":")


@pytest.mark.parametrize("query, field", [
    ({"gpus": "4", "zero": "0", "offload": "optimizer+params"}, "offload"),  # needs ZeRO-2/3
    ({"gpus": "4", "zero": "3", "offload": "optimizer"}, "offload"),  # torchao's optimizer offload is single-GPU
    ({"gpus": "4", "zero": "all", "offload": "optimizer+params"}, "offload"),  # compare varies the strategy
    ({"gpus": "4", "zero": "3", "loss": "fused-linear-ce"}, "loss"),  # not modelled under FSDP2
])
def test_options_invalid_for_the_strategy_fall_back_to_their_default_not_to_another_strategy(query, field):
    decoded, warnings = decode(query)
    assert getattr(decoded, field) is getattr(AppInputs(), field)
    assert decoded.zero == (ALL if query["zero"] == "all" else int(query["zero"]))
    assert any(w.startswith(field + ":") for w in warnings)
    decoded.to_plan()


def test_method_lora_rank_targets_and_grad_accum_round_trip_under_their_cli_names():
    inputs = AppInputs(model="qwen2.5-0.5b", gpus=8, zero=1, method=Method.LORA, lora_rank=8,
                       lora_targets="q_proj,v_proj", grad_accum=4)
    query = encode(inputs)
    assert {k: query[k] for k in ("method", "lora-rank", "lora-targets", "grad-accum")} == {
        "method": "lora", "lora-rank": "8", "lora-targets": "q_proj,v_proj", "grad-accum": "4"}
    assert decode(query) == (inputs, [])
    plan = inputs.to_plan()
    assert (plan.method, plan.lora_rank, plan.lora_targets, plan.grad_accum) == (Method.LORA, 8, "q_proj,v_proj", 4)
    assert not {"method", "lora-rank", "lora-targets", "grad-accum"} & set(encode(AppInputs()))  # defaults: absent
    qlora = AppInputs(gpus=1, zero=0, precision=Precision.FP16, method=Method.QLORA, quant=Quant.NF4, lora_rank=64)
    assert decode(encode(qlora)) == (qlora, [])
    assert qlora.to_plan().method is Method.QLORA
    accum = AppInputs(gpus=4, zero=3, grad_accum=2)  # full fine-tuning: every scheme accumulates
    assert decode(encode(accum)) == (accum, []) and accum.to_plan().grad_accum == 2


@pytest.mark.parametrize("zero", ["0", "1", "all"])
def test_qlora_links_keep_ddp_and_zero1_on_several_gpus(zero):
    query = {"method": "qlora", "quant": "fp4", "precision": "bf16", "gpus": "4", "zero": zero}
    inputs, warnings = decode(query)
    assert warnings == [] and (inputs.method, inputs.quant, inputs.gpus) == (Method.QLORA, Quant.FP4, 4)
    assert decode(encode(inputs)) == (inputs, [])
    if zero != "all":
        assert inputs.to_plan().zero == int(zero)


def test_old_quant_only_links_still_mean_qlora_and_method_qlora_defaults_to_nf4():
    inputs, warnings = decode({"quant": "fp4", "precision": "bf16", "gpus": "1"})
    assert (inputs.method, inputs.quant, warnings) == (Method.QLORA, Quant.FP4, [])
    inputs, warnings = decode({"method": "qlora", "precision": "bf16"})
    assert (inputs.method, inputs.quant, warnings) == (Method.QLORA, Quant.NF4, [])
    inputs, warnings = decode({"method": "qlora", "quant": "none", "precision": "bf16"})  # tampered: no base
    assert inputs.quant is Quant.NF4 and len(warnings) == 1 and warnings[0].startswith("quant:")
    inputs, warnings = decode({"method": "lora", "quant": "nf4"})  # a 4-bit base belongs to qlora only
    assert (inputs.method, inputs.quant) == (Method.LORA, Quant.NONE) and warnings[0].startswith("quant:")


@pytest.mark.parametrize("query, field", [
    ({"method": "dora"}, "method"), ({"method": ""}, "method"), ({"lora-rank": "0"}, "lora-rank"),
    ({"lora-rank": "99999"}, "lora-rank"), ({"lora-rank": "8.5"}, "lora-rank"), ({"grad-accum": "0"}, "grad-accum"),
    ({"grad-accum": "-1"}, "grad-accum"), ({"grad-accum": "1e3"}, "grad-accum"),
    ({"lora-targets": "../etc"}, "lora-targets"), ({"lora-targets": "q_proj;rm"}, "lora-targets"),
])
def test_tampered_method_values_warn_and_take_the_default(query, field):
    inputs, warnings = decode(query)
    assert inputs == AppInputs()
    assert len(warnings) == 1 and warnings[0].startswith(f"{field}:") and "using" in warnings[0]


# LoRA with TP: the default targets include row-parallel ones (o_proj, down_proj), refused first
@pytest.mark.parametrize("query, named", [
    ({"method": "qlora", "precision": "bf16", "gpus": "4", "tp": "4", "zero": "0"}, "tensor parallelism"),
    ({"method": "qlora", "precision": "bf16", "gpus": "4", "tp": "2", "zero": "3"}, "tensor parallelism"),
    ({"method": "lora", "gpus": "8", "tp": "2", "zero": "3"}, "row-parallel"),
    ({"method": "lora", "gpus": "8", "tp": "8", "zero": "0"}, "row-parallel"),
])
def test_invalid_method_combinations_fall_back_to_full_with_a_warning_naming_method(query, named):
    inputs, warnings = decode(query)
    assert (inputs.method, inputs.quant) == (Method.FULL, Quant.NONE)
    assert inputs.gpus == int(query.get("gpus", 1)) and inputs.precision == AppInputs().precision.parse(
        "precision", query.get("precision", "bf16-mixed"))  # the rest of the link is kept
    hits = [w for w in warnings if w.startswith("method:")]
    assert len(hits) == 1 and named in hits[0] and hits[0].endswith("using full")
    inputs.to_plan()  # a valid plan


@pytest.mark.parametrize("precision, pure", [("bf16-mixed", Precision.BF16), ("fp16-mixed", Precision.FP16)])
def test_qlora_with_a_mixed_precision_is_kept_where_modelled_else_takes_its_compute_dtype(precision, pure):
    """QLoRA with a mixed precision over a 4-bit base is modelled on one GPU (autocast) and under FSDP2 (its
    MixedPrecisionPolicy): the link keeps it; over an 8-bit base it is not, and the link takes the base's compute
    dtype, a pure precision, as the app's fix on choosing qlora does."""
    for extra in ({}, {"gpus": "2", "zero": "3"}):
        inputs, warnings = decode({"method": "qlora", "precision": precision, **extra})
        assert (inputs.method, inputs.quant, inputs.precision.value, warnings) == (Method.QLORA, Quant.NF4, precision,
                                                                                   [])
    inputs, warnings = decode({"method": "qlora", "quant": "int8", "precision": precision})
    assert (inputs.method, inputs.quant, inputs.precision) == (Method.QLORA, Quant.INT8, pure)
    assert len(warnings) == 1 and warnings[0].startswith("precision:") and f"using {pure}" in warnings[0]
    inputs.to_plan()


def test_valid_lora_strategies_and_partial_checkpointing_are_kept():
    for query in ({"method": "lora", "gpus": "8", "zero": "1"}, {"method": "lora", "gpus": "8", "zero": "all"},
                  {"method": "lora", "gpus": "8", "zero": "3", "precision": "bf16"},
                  {"method": "lora", "gpus": "4", "zero": "2", "precision": "fp32"},
                  {"method": "lora", "gpus": "8", "zero": "3"},  # FSDP2 + bf16-mixed (MixedPrecisionPolicy)
                  {"method": "lora", "gpus": "4", "zero": "2", "precision": "fp16-mixed"}):
        inputs, warnings = decode(query)
        assert inputs.method is Method.LORA and warnings == [], (query, warnings)
        inputs.to_plan()
    for query in ({"method": "qlora", "quant": "nf4", "gpus": "4", "zero": "3", "precision": "bf16"},
                  {"method": "qlora", "quant": "fp4", "gpus": "2", "zero": "2", "precision": "fp32"}):  # FSDP2
        inputs, warnings = decode(query)
        assert inputs.method is Method.QLORA and inputs.zero == int(query["zero"]) and warnings == [], (query, warnings)
        inputs.to_plan()
    inputs, warnings = decode({"method": "lora", "grad-ckpt": "full", "ckpt-every": "2"})
    assert (inputs.method, inputs.ckpt_every, warnings) == (Method.LORA, 2, [])
    assert inputs.to_plan().ckpt_every == 2
    inputs, warnings = decode({"method": "lora", "ckpt-every": "2"})  # without --grad-ckpt full: falls back
    assert inputs.ckpt_every == 1 and len(warnings) == 1 and warnings[0].startswith("ckpt-every:")



def test_int8_base_round_trips():
    inputs = AppInputs(model="llama-2-7b", gpus=1, zero=0, precision=Precision.BF16, method=Method.QLORA,
                       quant=Quant.INT8)
    assert decode(encode(inputs)) == (inputs, [])
    assert inputs.to_plan().quant is Quant.INT8


def test_lora_modules_to_save_round_trips_and_tampered_values_fall_back():
    inputs = AppInputs(model="llama-3.1-8b", gpus=2, zero=0, method=Method.LORA,
                       lora_modules_to_save="lm_head,embed_tokens")
    query = encode(inputs)
    assert query["lora-modules-to-save"] == "lm_head,embed_tokens"
    assert decode(query) == (inputs, [])
    assert inputs.to_plan().lora_modules_to_save == "lm_head,embed_tokens"
    assert "lora-modules-to-save" not in encode(AppInputs())  # default (none): absent
    for bad in ("lm_head;rm", "../etc"):  # not module names
        decoded, warnings = decode({"method": "lora", "lora-modules-to-save": bad})
        assert decoded.lora_modules_to_save == "" and warnings[0].startswith("lora-modules-to-save:")
    decoded, warnings = decode({"lora-modules-to-save": "lm_head"})  # full fine-tuning trains lm_head anyway
    assert decoded.lora_modules_to_save == "" and warnings[0].startswith("lora-modules-to-save:")
    decoded, warnings = decode({"method": "lora", "precision": "bf16", "gpus": "4", "zero": "3", "offload":
                                "optimizer+params", "lora-modules-to-save": "lm_head"})  # FSDP2 offload: a gap
    assert (decoded.zero, decoded.lora_modules_to_save) == (3, "")
    assert warnings[0].startswith("lora-modules-to-save:")
    decoded.to_plan()


def test_double_quant_round_trips_and_is_dropped_without_a_4bit_base():
    inputs = AppInputs(model="llama-2-7b", gpus=1, zero=0, precision=Precision.BF16, method=Method.QLORA,
                       quant=Quant.NF4, double_quant=True)
    query = encode(inputs)
    assert query["double-quant"] == "true"
    assert decode(query) == (inputs, [])
    assert inputs.to_plan().double_quant is True
    assert "double-quant" not in encode(AppInputs())  # default (off): absent
    decoded, warnings = decode({**query, "double-quant": "yes please"})
    assert decoded.double_quant is False and warnings[0].startswith("double-quant:")
    decoded, warnings = decode({**query, "quant": "int8"})  # an 8-bit base has no 4-bit block scales
    assert decoded.double_quant is False and any(w.startswith("double-quant:") for w in warnings)
    decoded.to_plan()


def test_engine_fsdp1_link_compares_its_strategies_and_keeps_one_gpu():
    """engine=fsdp1 with compare-all on 2 GPUs: the base plan is FSDP1 NO_SHARD, so the link keeps the engine; on
    one GPU FSDP1 runs a world of one (NO_SHARD), and the link keeps it too."""
    from llmem.plan import Engine

    two = AppInputs(model="gpt2", gpus=2, zero="all", engine=Engine.FSDP1)
    assert two.to_plan().engine is Engine.FSDP1 and two.to_plan().strategy_label == "ZeRO-0 (FSDP1 NO_SHARD)"
    kept, warnings = decode(encode(two))
    assert kept.engine is Engine.FSDP1 and not warnings
    one, warnings = decode(encode(two.with_(gpus=1)))
    assert one.engine is Engine.FSDP1 and not warnings
    assert one.to_plan().strategy_label == "one GPU (FSDP1 NO_SHARD, a world of one)"
