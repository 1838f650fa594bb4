"""Issue 16 in AppTest: a refused combination keeps the page (message next to the field, last result greyed, obvious
fixes applied with a note), "Make it fit", honest labels, offload under "compare all", one warning box for a link,
the sidebar's groups, the history script."""

import pytest
from streamlit.testing.v1 import AppTest

from llmem.ui.edits import GROUPS
from llmem.view import plain
from llmem.widgets import TABLE_WIDGETS

from .conftest import APP

SMALL = {"model": "llama-3.2-1b-instruct", "gpu-type": "a100-80gb", "gpus": "1", "zero": "all"}


def run(query: dict | None = None) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params.update(query or {})
    return at.run()


def verdicts(at: AppTest) -> list[str]:
    return [e.value for e in [*at.success, *at.warning, *at.error] if "Fits on" in e.value or "Short by" in e.value]


def group(at: AppTest, title: str):
    return next(e for e in at.sidebar.expander if e.label == title)


def stale(at: AppTest) -> list[str]:
    return [m.value for m in at.markdown if m.value.startswith("Last valid result")]


def applied_fixes(query: dict, count: int):
    """Each of the first `count` "Make it fit" changes clicked on a fresh page of `query`: (page, its label), after
    checking that the page has no error and its verdict fits."""
    for index in range(count):
        page = run(query)
        button = page.button(key=f"fix_{index}")
        label = button.help
        button.click().run()
        assert not page.exception and not page.error, label
        assert "Fits on" in verdicts(page)[0], (label, verdicts(page))
        yield page, label


def notes(at: AppTest) -> str:
    return " ".join(i.value.replace("\\", "") for i in at.info)


def test_qlora_from_a_mixed_precision_page_switches_to_its_compute_dtype_with_a_note():
    at = run({**SMALL, "precision": "bf16-mixed"})
    at.selectbox(key="w_method").set_value("qlora").run()
    assert not at.exception and not at.error
    assert at.selectbox(key="w_precision").value == "bf16" and at.selectbox(key="w_quant").value == "nf4"
    assert "precision bf16-mixed → bf16" in notes(at)
    assert len(verdicts(at)) == 1 and "QLoRA nf4" in verdicts(at)[0]
    at.number_input(key="w_batch").set_value(2).run()  # the note was for that edit only
    assert "precision bf16-mixed" not in notes(at)


def test_a_refused_field_shows_its_message_next_to_it_and_the_last_result_stays_greyed():
    at = run({**SMALL, "method": "qlora", "quant": "int8", "precision": "bf16"})
    before = at.table[0].value
    at.selectbox(key="w_precision").set_value("fp16-mixed").run()  # an 8-bit base under autocast: not modelled
    assert not at.exception
    inline = [e.value for e in group(at, "Precision & optimizer").error]
    assert len(inline) == 1 and plain("precision") in inline[0] and "“Precision”" in inline[0]  # app words, no --
    assert "--precision" not in inline[0].replace("\\", "")
    assert not verdicts(at) and stale(at)  # no verdict for the refused inputs; the last one, greyed
    assert at.table[0].value.equals(before)
    assert at.query_params["precision"] == "fp16-mixed"  # the link keeps what the user chose
    at.selectbox(key="w_precision").set_value("fp16").run()  # fixed: a fresh answer, nothing greyed
    assert verdicts(at) and not stale(at) and not at.error


def test_an_offline_hub_id_shows_its_message_under_the_model_and_keeps_the_result():
    at = run(SMALL)
    at.radio(key="w_source").set_value("Hugging Face id").run()
    at.text_input(key="w_hub").set_value("no-such-org-llmem/no-such-model-llmem").run()
    assert not at.exception
    assert any(plain("no-such-org-llmem/no-such-model-llmem") in e.value for e in group(at, "Model").error)
    assert stale(at) and at.table


def test_a_too_long_sequence_shows_its_message_in_the_batch_group_and_keeps_the_result():
    at = run(SMALL)
    at.number_input(key="w_batch").set_value(4096).run()
    at.number_input(key="w_seq").set_value(8192).run()
    assert not at.exception
    assert any(plain("batch-size") in e.value for e in group(at, "Batch").error)
    assert stale(at) and at.table


def test_make_it_fit_offers_changes_for_8b_on_one_a100_and_applying_one_fits():
    query = {"model": "llama-3.1-8b", "gpu-type": "a100-80gb", "gpus": "1", "zero": "all"}
    at = run(query)
    assert "Short by" in verdicts(at)[0]
    assert any(s.value == "Make it fit" for s in at.subheader)
    fixes = [b for b in at.button if b.key.startswith("fix_")]
    assert len(fixes) >= 3
    assert any("Fewest" in m.value and "NVIDIA A100 80GB" in m.value for m in at.markdown)
    for page, _ in applied_fixes(query, len(fixes)):  # every offered change, applied on a fresh page, fits
        assert "Applied" in notes(page)


def test_the_header_names_the_model_and_counts_what_lora_trains():
    at = run({**SMALL, "method": "lora"})
    header = next(m.value for m in at.markdown if "parameters" in m.value).replace("\\", "")
    assert header.startswith("**llama-3.2-1b-instruct**") and "(llama)" not in header
    assert " M trained" in header  # LoRA's adapters, not the whole model
    full = run(SMALL)
    assert "all of them trained" in next(m.value for m in full.markdown if "parameters" in m.value)


def test_tokens_per_step_use_the_micro_batch_and_grad_accum_and_are_zero_where_nothing_fits():
    at = run({"model": "llama-3.1-8b", "gpus": "8", "batch-size": "2", "grad-accum": "4", "seq-len": "1024"})
    shown = at.table[0].value
    for _, row in shown.iterrows():
        dp = 8 // row["TP"]
        assert row["tokens/step"] == (2 * 4 * 1024 * dp if row["fits"] == "yes" else 0)
    assert (shown["fits"] == "no").any() and (shown["fits"] == "yes").any()


@pytest.mark.parametrize("query", [
    {**SMALL, "offload": "optimizer"},
    {"model": "llama-3.1-8b", "gpus": "4", "tp": "1", "zero": "3", "offload": "optimizer+params"},
])
def test_offload_fills_the_host_ram_column(query):
    at = run(query)
    assert not at.exception and not at.error
    assert (at.table[0].value["host RAM per node (GiB)"] > 0).all()
    assert "host RAM per node (GiB)" not in run(SMALL).table[0].value.columns  # no offload: no column of zeros


def test_offload_under_compare_all_picks_zero3_and_the_link_reopens_without_warnings():
    at = run({"model": "llama-3.1-8b", "gpus": "8", "zero": "all"})
    at.selectbox(key="w_offload").set_value("optimizer+params").run()
    assert not at.exception and not at.error
    assert at.selectbox(key="w_strategy").value == "1:3" and "ZeRO-3" in notes(at)
    assert at.query_params["zero"] == "3" and at.query_params["offload"] == "optimizer+params"
    reopened = run(dict(at.query_params))
    assert not [w for w in reopened.warning if w.value.startswith("Share link")]
    assert reopened.selectbox(key="w_offload").value == "optimizer+params"
    assert verdicts(reopened) == verdicts(at)


def test_chunked_ce_under_compare_all_is_compared_on_every_strategy_and_the_link_reopens_without_warnings():
    """chunked-ce runs on every strategy (unlike offload or the fused loss): "compare all" keeps it, each row is
    the plan with it (the table's figures are those of that plan), and the link holds what is shown."""
    at = run({"model": "llama-3.2-1b-instruct", "gpus": "8", "zero": "all"})
    standard = at.table[0].value["device total (GiB)"]
    at.selectbox(key="w_loss").set_value("chunked-ce").run()
    assert not at.exception and not at.error
    assert at.selectbox(key="w_strategy").value == "all" and at.query_params["loss"] == "chunked-ce"
    chunked = at.table[0].value["device total (GiB)"]
    assert [f"chunked-ce ×8 · {label}" for label in standard.index] == list(chunked.index)  # every strategy, with it
    assert (chunked.to_numpy() != standard.to_numpy()).any()
    reopened = run(dict(at.query_params))
    assert not [w for w in reopened.warning if w.value.startswith("Share link")]
    assert verdicts(reopened) == verdicts(at)


def test_a_links_warnings_are_in_the_apps_words():
    """A link's repair names the link's key (the option's name), its fix the widget to change, not `--option`."""
    at = run({**SMALL, "method": "qlora", "quant": "int8", "precision": "bf16", "gpus": "2", "zero": "3"})
    shown = " ".join(w.value for w in at.warning if w.value.startswith("Share link")).replace("\\", "")
    assert "method:" in shown and "“Strategy” 0 or 1" in shown and "--zero" not in shown


def test_a_bad_link_shows_one_warning_box_that_goes_away_after_an_edit():
    at = run({"gpus": "-4", "batch-size": "lots", "precision": "fp8", "colour": "blue", "zero": "9"})
    boxes = [e for e in at.main.expander if e.label.startswith("⚠️ Share link")]
    assert len(boxes) == 1 and "5 value(s)" in boxes[0].label
    assert len([w for w in at.warning if w.value.startswith("Share link")]) == 1
    at.number_input(key="w_batch").set_value(2).run()
    assert not [e for e in at.main.expander if e.label.startswith("⚠️ Share link")]
    assert not [w for w in at.warning if w.value.startswith("Share link")]


def test_the_sidebar_is_grouped_with_the_strategy_beside_the_gpu_count():
    at = run(SMALL)
    titles = [e.label for e in at.sidebar.expander]
    groups = [title for title, _ in GROUPS]
    assert titles == [groups[0], "Import training configs", *groups[1:]]  # the import box right under Model
    hardware = group(at, "Hardware")
    keys = [w.key for w in hardware.selectbox]
    assert keys[:2] == ["w_gpu", "w_strategy"] and "w_engine" in keys  # the engine runs the strategy
    assert [w.key for w in hardware.number_input][0] == "w_gpus"  # (then the pipeline's stages and microbatches)
    found = {}
    for box in at.sidebar.expander:
        for kind in ("selectbox", "number_input", "text_input", "checkbox"):
            for w in getattr(box, kind):
                found.setdefault(w.key, []).append(box.label)
    for option in TABLE_WIDGETS:
        assert len(found.get(option.widget.key, [])) == 1, option.name


def test_edits_replace_the_history_entry_instead_of_adding_one():
    at = run(SMALL)
    script = at.get("html")[0].proto.body
    assert "h.pushState=function" in script and "h.replaceState(s,t,u)" in script


def test_the_gpu_grid_is_computed_on_demand_and_agrees_with_the_verdict():
    at = run(SMALL)
    assert not at.dataframe  # not computed until asked for
    at.toggle(key="w_grid").set_value(True).run()
    grid = at.dataframe[0].value
    assert "NVIDIA A100 80GB" in set(grid["GPU type"]) and "1 GPU" in grid.columns
    headroom = grid.set_index("GPU type").loc["NVIDIA A100 80GB", "1 GPU"]
    assert headroom == pytest.approx(at.table[0].value["headroom (GiB)"].iloc[0], abs=0.06)


def test_the_gpu_grid_colours_each_cell_by_its_verdict():
    import re

    from llmem.ui.results import GRID_COLOURS

    at = run({"model": "llama-3.1-8b", "gpu-type": "a100-80gb", "gpus": "1", "zero": "all"})
    at.toggle(key="w_grid").set_value(True).run()
    grid = at.dataframe[0]
    values = grid.value.drop(columns="GPU type")
    colour = {}  # (row, column) -> colour; column 0 is the GPU type, uncoloured
    rules = re.findall(r"([^{}]+)\{ background-color: (#[0-9a-f]{6}) \}", grid.proto.arrow_data.styler.styles)
    for cells, hex_ in rules:
        colour |= {(int(r), int(c)): hex_ for r, c in re.findall(r"_row(\d+)_col(\d+)", cells)}
    assert len(colour) == values.size and not any(c == 0 for _, c in colour)
    for (r, c), hex_ in colour.items():
        assert (hex_ == GRID_COLOURS["no"]) == (values.iloc[r, c - 1] < 0), (r, c)
    one = values.columns.get_loc("1 GPU") + 1
    a100 = list(grid.value["GPU type"]).index("NVIDIA A100 80GB")
    assert colour[(a100, one)] == GRID_COLOURS["no"]  # the verdict on the page: short on one A100


def test_make_it_fit_marks_a_change_that_fits_only_at_the_low_end_and_applying_it_says_risky():
    """8B full fine-tuning on one A100 40GB: the fewest GPUs (5) fit at the low end only; the panel says so before
    the click, and the verdict after it."""
    query = {"model": "llama-3.1-8b", "gpu-type": "a100-40gb", "gpus": "1", "zero": "all"}
    at = run(query)
    count = len([b for b in at.button if b.key.startswith("fix_")])
    marked = [m.value for m in at.markdown if "at the high end" in m.value]
    assert any("risky" in m for m in marked)
    fewest = next(m.value for m in at.markdown if m.value.startswith("Fewest"))
    said_risky = []
    for page, label in applied_fixes(query, count):
        risky = "only at the low end (risky)" in verdicts(page)[0]
        said_risky.append(risky)
        if "GPUs (1 →" in label:
            assert risky == ("risky" in fewest), (label, fewest)
    assert sum(said_risky) == len([m for m in marked if "**risky**" in m])  # each risky change was marked


def test_back_to_the_link_first_opened_reopens_it_and_the_apps_own_addresses_do_not():
    opened = {**SMALL, "batch-size": "4"}
    at = run(opened)
    at.number_input(key="w_batch").set_value(2).run()
    written = dict(at.query_params)
    assert written["batch-size"] == "2"
    at.run()  # a rerun carrying the address the app wrote: nothing moves
    assert at.number_input(key="w_batch").value == 2
    at.query_params.clear()
    at.query_params.update(opened)  # Back: the browser shows the link first opened and reruns the script
    at.run()
    assert not at.exception
    assert at.number_input(key="w_batch").value == 4 and at.query_params["batch-size"] == "4"


def test_server_settings_cap_uploads_stop_file_watching_and_hide_deploy_and_the_uploader_says_the_real_limit():
    import tomllib

    from llmem.sources import MAX_CONFIG_BYTES

    from .conftest import ROOT

    config = tomllib.loads((ROOT / ".streamlit" / "config.toml").read_text())
    assert config["server"]["maxUploadSize"] == 1 and MAX_CONFIG_BYTES <= 1 << 20
    assert config["server"]["fileWatcherType"] == "none" and config["client"]["toolbarMode"] == "minimal"
    assert ".streamlit" in (ROOT / "Dockerfile").read_text()
    at = run(SMALL)
    at.radio(key="w_source").set_value("Upload config.json").run()
    assert f"{MAX_CONFIG_BYTES // 1024} KiB" in at.get("file_uploader")[0].proto.label


def test_make_it_fit_on_a_chosen_strategy_keeps_or_sets_the_strategy_each_change_names():
    query = {"model": "llama-3.1-8b", "gpu-type": "a100-80gb", "gpus": "8", "tp": "1", "zero": "0",
             "batch-size": "2"}
    at = run(query)
    assert "Short by" in verdicts(at)[0] and "DDP" in verdicts(at)[0]
    count = len([b for b in at.button if b.key.startswith("fix_")])
    assert count >= 3
    for page, label in applied_fixes(query, count):
        assert page.selectbox(key="w_strategy").value != "all", label  # a chosen strategy stays chosen


def _hub_id(at: AppTest, model: str) -> AppTest:
    at.radio(key="w_source").set_value("Hugging Face id").run()
    return at.text_input(key="w_hub").set_value(model).run()


def test_an_unreachable_hub_answers_in_seconds_from_the_cache_or_with_what_to_do(monkeypatch):
    import time

    from llmem.ui import cache

    from .conftest import ROOT

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # as on a server: the hub client would retry for about 30 s
    monkeypatch.setattr(cache, "hub_reachable", lambda: False)
    monkeypatch.setattr(cache, "cached_config_path", lambda repo: None)
    at = run(SMALL)
    start = time.perf_counter()
    _hub_id(at, "offline-org-llmem/not-cached-llmem")
    assert time.perf_counter() - start < 10 and not at.exception
    message = " ".join(e.value for e in group(at, "Model").error).replace("\\", "")
    assert "offline" in message and "pick a preset or upload its config.json" in message
    assert stale(at)
    gpt2 = str(ROOT / "presets" / "gpt2" / "config.json")
    monkeypatch.setattr(cache, "cached_config_path", lambda repo: gpt2 if repo == "offline-org-llmem/cached" else None)
    _hub_id(at, "offline-org-llmem/cached")
    assert not at.exception and not at.error and verdicts(at)
    assert any("Hugging Face cache" in m.value.replace("\\", "") for m in at.markdown)


def test_with_offload_the_strategies_are_those_it_runs_on_and_compare_all_drops_it_with_a_note():
    at = run({"model": "llama-3.1-8b", "gpus": "8", "tp": "1", "zero": "3", "offload": "optimizer+params"})
    options = at.selectbox(key="w_strategy").options  # as shown: "Compare all …", "<label> (TP t, ZeRO z)"
    assert len(options) == 3 and all(o.startswith("Compare all") or "ZeRO 2)" in o or "ZeRO 3)" in o for o in options)
    at.selectbox(key="w_strategy").set_value("all").run()
    assert not at.exception and not at.error
    assert at.selectbox(key="w_offload").value == "none" and "offload optimizer+params → none" in notes(at)
    assert at.query_params["offload"] == "none" and at.query_params["zero"] == "all"
    assert len(at.table[0].value) >= 4  # every strategy compared again


def test_the_table_leads_with_the_columns_that_decide():
    at = run({"model": "llama-3.1-8b", "gpus": "8"})
    assert list(at.table[0].value.columns[:4]) == ["fits", "device total (GiB)", "headroom (GiB)",
                                                  "device total, high end (GiB)"]


def test_an_imported_training_config_fills_the_inputs_and_reports_what_it_used():
    """The sidebar's import box: a torchtune LoRA recipe sets the model and LoRA fields, the report is shown once."""
    from pathlib import Path

    data = (Path(__file__).parents[1] / "data" / "configs" / "torchtune_8B_lora.yaml").read_bytes()
    at = run(SMALL)
    at.file_uploader(key="w_import").set_value([("recipe.yaml", data, "application/yaml")]).run()
    at.button(key="w_import_apply").click().run()
    assert not at.exception
    assert at.session_state.w_preset == "llama-3.1-8b" and at.session_state.w_method == "lora"
    assert "Imported recipe.yaml" in notes(at) and "used" in notes(at)
    assert at.query_params["model"] == "llama-3.1-8b"


def test_the_page_carries_the_phone_layout_and_hides_streamlits_upload_limit():
    """What only a browser can show is checked in tests/app/test_e2e.py; here, that every page carries the rules:
    on a phone the sidebar's groups below the results (no drawer toggle) and the verdict's line at the foot of the
    screen, and no "1MB per file" in the drop zones."""
    at = run(SMALL)
    page_css = " ".join(e.proto.body for e in at.get("html"))
    phone = page_css[page_css.index("@media (max-width:640px)"):]
    assert "[data-testid='stSidebar']{order:2" in phone and "[data-testid='stExpandSidebarButton']" in phone
    assert "[data-testid='stFileUploaderDropzoneInstructions']{display:none}" in page_css
    bar = [e.proto.body for e in at.get("html") if "llmem-phone-verdict" in e.proto.body and "<div" in e.proto.body]
    assert len(bar) == 1 and "llmem-fits" in bar[0] and "Fits with" in bar[0] and "NVIDIA A100 80GB" in bar[0]
    at.selectbox(key="w_method").set_value("qlora").run()
    at.selectbox(key="w_quant").set_value("int8").run()
    at.selectbox(key="w_precision").set_value("fp16-mixed").run()  # refused: the line says so, nothing stale in it
    bar = [e.proto.body for e in at.get("html") if "llmem-phone-verdict" in e.proto.body and "<div" in e.proto.body]
    assert len(bar) == 1 and "Not a plan yet" in bar[0]


def test_on_a_plan_over_the_capacity_the_charts_label_their_bars_and_mark_the_current_point():
    """Issue 16, item 10 (the boxes as drawn are checked in tests/app/test_e2e.py): no empty legend entry, a value on
    every bar, the capacity's label over the small bar outside the allocator, and the current point on each curve,
    inside the y range."""
    import json

    at = run({"model": "llama-3.1-8b", "gpu-type": "a100-80gb", "gpus": "1", "zero": "all"})
    assert "Short by" in verdicts(at)[0]
    breakdown, *curves = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    bars = breakdown["data"]
    assert bars and all(b["y"][0] > 0 and b["text"] == [f"{b['y'][0]:.2f}"] for b in bars)
    label = breakdown["layout"]["annotations"][0]
    assert (label["x"], label["xanchor"]) == (1, "right") and len(label["text"]) <= 16
    assert breakdown["layout"]["xaxis"]["tickangle"] == 0
    assert max(len(part) for b in bars for part in b["x"][0].split("<br>")) <= 12
    for spec in curves:
        current = next(t for t in spec["data"] if t["name"].startswith("current"))
        assert 0 < current["y"][0] <= spec["layout"]["yaxis"]["range"][1]
