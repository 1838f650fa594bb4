"""Fine-tuning methods in the app, driven headless with AppTest: LoRA / QLoRA links and widgets, grad-accum,
double quantization, the FSDP2 shard dim, other methods beside the plan's rows."""


from .test_app import PRESET, assert_clean, link_warnings, run, table, verdict


def test_qlora_link_renders_and_lowers_the_peak():
    query = {"model": "llama-2-7b", "gpus": "1", "zero": "0", "precision": "bf16", "seq-len": "512"}
    full, qlora = run(query), run({**query, "quant": "nf4"})
    assert_clean(full)
    assert_clean(qlora)
    assert qlora.selectbox(key="w_quant").value == "nf4" and not link_warnings(qlora)
    assert verdict(qlora) != verdict(full)


def test_offload_link_shows_the_host_memory_and_keeps_the_option():
    at = run({"model": PRESET, "gpus": "4", "zero": "3", "offload": "optimizer+params"})
    assert_clean(at)
    assert at.selectbox(key="w_offload").value == "optimizer+params"
    assert any("host memory" in c.value for c in at.caption)
    assert at.query_params["offload"] == "optimizer+params"


def test_other_methods_appear_as_rows_and_travel_in_the_link():
    at = run({"model": "llama-3.2-1b-instruct", "gpus": "4", "methods": "qlora,lora"})
    assert_clean(at)
    assert not link_warnings(at)
    shown = table(at)
    labels = list(shown.index)
    assert any(label.startswith("LoRA r=16") for label in labels) and any(label.startswith("QLoRA nf4") for label in
                                                                          labels)
    starred = shown[shown["recommended"] == "yes"]
    assert len(starred) == 1 and not starred.index[0].startswith(("LoRA", "QLoRA"))
    assert at.query_params["methods"] == "lora,qlora"
    options = at.selectbox(key="w_strategy").options  # the strategy choice lists the plan's own rows only
    assert not any("LoRA" in o for o in options)
    tampered = run({"methods": "dora"})
    assert_clean(tampered)
    assert any("methods" in w and "dora" in w for w in link_warnings(tampered))


def test_lora_link_renders_a_lora_verdict_and_table_and_keeps_its_keys():
    query = {"model": "llama-3.2-1b-instruct", "gpus": "8", "method": "lora", "lora-rank": "8", "grad-accum": "2"}
    at = run(query)
    assert_clean(at)
    assert not link_warnings(at)
    assert "LoRA r=8" in verdict(at)
    shown = table(at)
    assert all(label.startswith("LoRA r=8") for label in shown.index)
    # LoRA runs on DDP, ZeRO-1 and FSDP2 ZeRO-2/3 (bf16-mixed: the adapters gathered in bf16); no TP rows
    assert sorted(shown["ZeRO"]) == [0, 1, 2, 3] and set(shown["TP"]) == {1}
    assert at.number_input(key="w_lora_rank").value == 8 and not at.number_input(key="w_lora_rank").disabled
    assert at.selectbox(key="w_quant").disabled
    for key, value in query.items():
        assert at.query_params[key] == value
    pure = run({**query, "precision": "bf16"})  # a pure dtype: the same strategies, other figures
    assert_clean(pure)
    assert sorted(table(pure)["ZeRO"]) == [0, 1, 2, 3]
    assert list(table(pure)["per-GPU peak (GiB)"]) != list(shown["per-GPU peak (GiB)"])


def test_lora_modules_to_save_link_renders_and_keeps_its_key():
    query = {"model": "llama-3.1-8b", "gpus": "8", "method": "lora", "lora-modules-to-save": "lm_head"}
    at = run(query)
    assert_clean(at)
    assert not link_warnings(at)
    assert at.text_input(key="w_lora_mts").value == "lm_head" and not at.text_input(key="w_lora_mts").disabled
    assert at.query_params["lora-modules-to-save"] == "lm_head"
    assert sorted(table(at)["ZeRO"]) == [0, 1, 2, 3]  # FSDP2: the copies in the root group
    pure = run({**query, "precision": "bf16"})  # ZeRO-1 takes one dtype: DDP and FSDP2
    assert_clean(pure)
    assert sorted(table(pure)["ZeRO"]) == [0, 2, 3]
    tied = run({**query, "model": "llama-3.2-1b-instruct"})  # tied embeddings: PEFT's copies break the tie
    assert_clean(tied)
    assert not link_warnings(tied) and sorted(table(tied)["ZeRO"]) == [0, 1, 2, 3]


def test_qlora_link_via_method_renders_with_the_nf4_base():
    query = {"model": "llama-2-7b", "gpus": "1", "zero": "0", "precision": "bf16", "seq-len": "512"}
    full, qlora = run(query), run({**query, "method": "qlora"})
    assert_clean(qlora)
    assert not link_warnings(qlora)
    assert qlora.selectbox(key="w_method").value == "qlora" and qlora.selectbox(key="w_quant").value == "nf4"
    assert "QLoRA nf4" in verdict(qlora) and verdict(qlora) != verdict(full)
    assert qlora.query_params["method"] == "qlora" and qlora.query_params["quant"] == "nf4"


def test_a_qlora_link_with_a_mixed_precision_opens_as_modelled():
    """QLoRA with a mixed precision over a 4-bit base is modelled on one GPU (autocast) and under FSDP2 (its
    MixedPrecisionPolicy): the link opens as it is, no warning. Over an 8-bit base it is not: the precision becomes
    the base's compute dtype, with one warning saying so."""
    for where in ({"gpus": "1", "zero": "0"}, {"gpus": "2", "zero": "3"}):
        at = run({"model": "llama-2-7b", **where, "method": "qlora", "precision": "bf16-mixed"})
        assert_clean(at)
        assert at.selectbox(key="w_method").value == "qlora" and at.selectbox(key="w_precision").value == "bf16-mixed"
        assert "QLoRA nf4" in verdict(at) and not link_warnings(at)
    at = run({"model": "llama-2-7b", "gpus": "1", "zero": "0", "method": "qlora", "quant": "int8",
              "precision": "bf16-mixed"})
    assert_clean(at)
    assert at.selectbox(key="w_method").value == "qlora" and at.selectbox(key="w_precision").value == "bf16"
    assert len(link_warnings(at)) == 1 and "precision" in link_warnings(at)[0]


def test_grad_accum_raises_the_peak_and_travels_in_the_link():
    query = {"model": "llama-3.2-1b-instruct", "gpus": "1", "zero": "0"}
    one, four = run(query), run({**query, "grad-accum": "4"})
    assert_clean(four)
    assert not link_warnings(four)
    assert four.query_params["grad-accum"] == "4" and "grad-accum" not in one.query_params
    assert table(four)["per-GPU peak (GiB)"].iloc[0] > table(one)["per-GPU peak (GiB)"].iloc[0]


def test_choosing_qlora_in_the_sidebar_enables_the_4bit_base_at_nf4():
    at = run({"model": "llama-2-7b", "gpus": "1", "zero": "0", "precision": "bf16", "seq-len": "512"})
    assert at.selectbox(key="w_quant").disabled and at.number_input(key="w_lora_rank").disabled
    at.selectbox(key="w_method").set_value("qlora").run()
    assert_clean(at)
    assert at.selectbox(key="w_quant").value == "nf4" and not at.selectbox(key="w_quant").disabled
    assert at.query_params["method"] == "qlora" and "QLoRA nf4" in verdict(at)
    at.selectbox(key="w_method").set_value("full").run()
    assert_clean(at)
    assert at.selectbox(key="w_quant").value == "none" and "method" not in at.query_params


def test_double_quant_link_lowers_the_qlora_parameters():
    query = {"model": "llama-2-7b", "gpus": "1", "zero": "0", "precision": "bf16", "method": "qlora", "quant": "nf4"}
    plain, nested = run(query), run({**query, "double-quant": "true"})
    assert_clean(nested)
    assert not link_warnings(nested)
    assert nested.checkbox(key="w_dq").value is True and not nested.checkbox(key="w_dq").disabled
    assert nested.query_params["double-quant"] == "true"
    assert table(nested)["per-GPU peak (GiB)"].iloc[0] < table(plain)["per-GPU peak (GiB)"].iloc[0]


def test_fsdp_shard_link_lowers_a_padded_mixtral_and_the_padding_note_shows():
    query = {"model": "mixtral-8x7b", "gpus": "64", "tp": "1", "zero": "3"}
    padded, dim1 = run(query), run({**query, "fsdp-shard": "dim1-if-short"})
    assert_clean(dim1)
    assert not link_warnings(dim1)
    assert dim1.selectbox(key="w_fsdp_shard").value == "dim1-if-short"
    assert dim1.query_params["fsdp-shard"] == "dim1-if-short"
    assert any("FSDP2 pads dim 0" in w.value.replace("\\", "") for w in padded.warning)
    assert not any("FSDP2 pads dim 0" in w.value.replace("\\", "") for w in dim1.warning)
    assert table(dim1).loc["ZeRO-3 (FSDP2, reshard after forward)", "per-GPU peak (GiB)"] < \
        table(padded).loc["ZeRO-3 (FSDP2, reshard after forward)", "per-GPU peak (GiB)"]


def test_qlora_on_several_gpus_is_a_plan_on_the_strategies_docs_app_md_names():
    """Issue 16, item 15: docs/APP.md said QLoRA on several GPUs is refused; it runs on DDP, ZeRO-1 and FSDP2
    ZeRO-2/3 (4-bit base, pure or mixed precision), and the page says what the app does."""
    from .conftest import ROOT

    at = run({"model": "llama-3.2-1b-instruct", "gpus": "8", "method": "qlora", "precision": "bf16"})
    assert_clean(at)
    assert not link_warnings(at)
    strategies = [label.split(" · ")[1] for label in table(at).index]
    assert [s.split(" (")[0] for s in strategies] == ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    doc = " ".join((ROOT / "docs" / "APP.md").read_text().split())
    assert "QLoRA runs on one GPU, DDP, ZeRO-1 and FSDP2 ZeRO-2/3 (4-bit base: pure or mixed precision)" in doc
    assert "refused" not in doc.split("QLoRA runs on")[1].split(".")[0]
