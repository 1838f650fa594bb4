"""llmem web app: widgets -> TrainingPlan -> llmem.estimate / llmem.compare -> verdict, charts, table.

Run with `streamlit run app.py`. Every input lives in the URL query string (`llmem.share`), so the address bar is
always a link that reopens the same view. No memory arithmetic happens here: the numbers come from the library
(`llmem.ui.cache`), the answer is drawn by `llmem.ui.results`, and what one widget change fixes in the others by
`llmem.ui.edits`. A refused combination shows its message under the field it names and keeps the last valid answer
on the page, greyed.
"""

from __future__ import annotations

import hashlib
import logging
import time
from urllib.parse import urlencode

import streamlit as st

from llmem import share, widgets
from llmem.compare import METHOD_VARIANTS
from llmem.errors import InputError
from llmem.gpus import get_gpu, list_gpus
from llmem.help import HELP
from llmem.options import ALL, BY_NAME, CHECK, NUMBER, SELECT, TEXT
from llmem.sources import MAX_CONFIG_BYTES
from llmem.ui import cache, edits, importbox, results, simulate
from llmem.units import format_gib
from llmem.view import plain

LOG = logging.getLogger("llmem.app")
WIDGET_KEYS = ("w_source", *widgets.WIDGET_KEYS)
SOURCE_PRESET, SOURCE_HUB, SOURCE_UPLOAD = "Preset", "Hugging Face id", "Upload config.json"
OPEN_GROUPS = ("Hardware", "Batch", "Method")  # the others open when they hold a non-default value or an error
# Streamlit writes each query-string change with history.pushState, so every edit would add a Back step (and Back
# is then overwritten by the app writing its inputs again): make those writes replace the entry instead.
REPLACE_HISTORY = ("<script>(function(){var h=window.history;if(h.__llmemReplace){return}h.__llmemReplace=true;"
                   "h.pushState=function(s,t,u){return h.replaceState(s,t,u)}})();</script>")
# The drop zones print Streamlit's per-file limit ("1MB per file": `server.maxUploadSize` is whole megabytes), not
# the app's (the labels say it: `MAX_CONFIG_BYTES`, 256 KiB); hide Streamlit's line.
UPLOAD_CSS = "<style>[data-testid='stFileUploaderDropzoneInstructions']{display:none}</style>"
# A phone (≤ 640 px): results first, the inputs' groups below them in the same scroll, instead of Streamlit's sidebar
# drawer that hides them behind a toggle and covers the verdict after each change. The page's scroller
# (stAppViewContainer) stacks the main column, then the sidebar at full width; its toggle and resize handle go.
PHONE_CSS = ("<style>@media (max-width:640px){"
             "[data-testid='stAppViewContainer']{flex-direction:column!important;overflow-y:auto!important}"
             "[data-testid='stAppViewContainer']>div:has(>[data-testid='stMain'])"
             "{order:1;height:auto!important;min-height:0!important;flex:none!important}"
             "[data-testid='stMain']{position:relative!important;height:auto!important;overflow:visible!important}"
             "[data-testid='stSidebar']{order:2;transform:none!important;width:100%!important;min-width:100%!important;"
             "max-width:100%!important;height:auto!important;flex:none!important}"
             "[data-testid='stSidebarContent']{width:100%!important;height:auto!important;overflow:visible!important}"
             "[data-testid='stSidebarHeader'],[data-testid='stSidebarResizeHandle'],"
             "[data-testid='stExpandSidebarButton']{display:none!important}}</style>")


# ---------------------------------------------------------------- inputs: URL <-> widgets

def _defaults() -> share.AppInputs:
    names = [p.name for p in cache.presets()]
    model = share.AppInputs().model
    return share.AppInputs(model=model if model in names or not names else names[0])


def _init_from_url() -> None:
    """First run of a session: put the link's values (none: the first view's, `edits.STARTER`) into the widgets and
    keep the warnings to show. Again when the address holds a link this session never wrote: Back or Forward to
    the link first opened (a rerun that carries an address the app wrote earlier is not one)."""
    query = st.query_params.to_dict()
    if "w_source" in st.session_state and _query_key(query) in st.session_state.get("written", ()):
        return
    defaults = _defaults()
    inputs, warnings = share.decode(st.query_params.to_dict() or edits.STARTER, defaults)
    if inputs.upload:
        warnings.append(f"upload: this link was made from an uploaded config ({inputs.upload}), which cannot travel "
                        f"in a URL; showing {inputs.model} instead. Upload the file again, or share a preset or "
                        "Hugging Face id")
    preset_names = [p.name for p in cache.presets()]
    ss = st.session_state
    ss.w_source = SOURCE_PRESET if inputs.model in preset_names else SOURCE_HUB
    ss.w_preset = inputs.model if inputs.model in preset_names else defaults.model
    ss.w_hub = "" if inputs.model in preset_names else inputs.model
    ss.update(widgets.state_from_inputs(inputs))
    if ss.w_source == SOURCE_HUB:
        try:  # a link's model that cannot be loaded (offline, gated, unknown) opens the default preset instead
            cache.spec_for_model(inputs.model)
        except InputError as err:
            warnings.append(f"{err}; showing {defaults.model} instead")
            ss.w_source, ss.w_hub = SOURCE_PRESET, ""
    ss.link_warnings, ss.notes = warnings, []


def _query_key(query: dict) -> tuple:
    return tuple(sorted(query.items()))


def _restore_widgets() -> None:
    """Streamlit forgets the value of a widget that a run did not draw (the preset box while an id is typed);
    keep a copy so that switching back, or an error that stops the page early, loses nothing."""
    for key, value in st.session_state.get("kept", {}).items():
        if key not in st.session_state:
            st.session_state[key] = value


def _remember_widgets() -> None:
    st.session_state.kept = {k: st.session_state[k] for k in WIDGET_KEYS if k in st.session_state}


def _edited(key: str) -> None:
    """Every widget's on_change: apply the obvious fixes (with notes); the link's warnings have been read."""
    st.session_state.notes = [f"Adjusted: {note}" for note in edits.on_edit(st.session_state, key)]
    st.session_state.link_warnings = []


def _apply(fix) -> None:
    """A "Make it fit" button: set the inputs the fix changes (its strategy too, unless comparing all)."""
    ss = st.session_state
    inputs = widgets.inputs_from_state(ss, ss.w_preset, "")
    changes = {k: v for k, v in fix.changes.items() if k in share.KEYS}
    keep_all = inputs.compare_all and (fix.kind not in ("strategy", "offload") or fix.plan.gpus == 1)
    changes |= {} if keep_all else {"tp": fix.plan.tp, "zero": fix.plan.zero}
    ss.update({k: v for k, v in widgets.state_from_inputs(inputs.with_(**changes)).items() if k != "w_upload"})
    ss.notes, ss.link_warnings = [f"Applied: {fix.label} (from Make it fit)"], []


def _model_widgets(box):
    """The model inputs: (model for the link, spec or None, origin, upload name, spec key, the model's title)."""
    ss = st.session_state
    source = box.radio("Model", (SOURCE_PRESET, SOURCE_HUB, SOURCE_UPLOAD), key="w_source", help=HELP["model"],
                       on_change=_edited, args=("w_source",))
    labels = cache.preset_labels()
    if ss.w_preset not in labels and labels:
        ss.w_preset = next(iter(labels))
    if source == SOURCE_PRESET:
        box.selectbox("Preset (type to search)", list(labels), key="w_preset", on_change=_edited,
                      args=("w_preset",), format_func=labels.get)
        return ss.w_preset, None, None, "", "", ss.w_preset
    if source == SOURCE_HUB:
        box.text_input("Hugging Face model id", key="w_hub", placeholder="org/name, e.g. Qwen/Qwen2.5-7B",
                       on_change=_edited, args=("w_hub",),
                       help="Only the model's config.json is fetched (needs network; gated models need HF_TOKEN). "
                            "Remote code is never run.")
        model = ss.w_hub.strip() or ss.w_preset
        return model, None, None, "", "", model
    upload = box.file_uploader(f"config.json (at most {MAX_CONFIG_BYTES // 1024} KiB)", type=["json"], key="w_upload",
                               on_change=_edited, args=("w_upload",),
                               help="A Hugging Face config.json. It stays in this session only.")
    box.info("An uploaded config can't travel in a share link: the link keeps only its file name. "
             "To share, pick the matching preset or use its Hugging Face id.")
    if upload is None:
        return ss.w_preset, None, None, "", "", ss.w_preset
    data = upload.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    spec, origin = cache.spec_for_upload(digest, data, upload.name)
    return ss.w_preset, spec, origin, upload.name, f"upload:{digest}", f"{upload.name} ({spec.name})"


def _import_box() -> None:
    """Training configs the user already has (`llmem.ui.importbox`): one click fills the inputs they determine."""
    box = st.sidebar.expander("Import training configs")
    files = box.file_uploader("DeepSpeed JSON; accelerate, Trainer / TRL, axolotl, LLaMA-Factory or torchtune YAML; "
                              "PEFT adapter_config.json (each at most 256 KiB)", type=["json", "yaml", "yml"],
                              accept_multiple_files=True, key="w_import",
                              help="Later files override earlier ones. Nothing in a file is run or opened.")
    engine = box.checkbox("Map DeepSpeed / FSDP1 settings to the nearest PyTorch program", key="w_import_torch",
                          help="llmem models PyTorch's ZeRO (ZeroRedundancyOptimizer, FSDP2) and FSDP1; without "
                               "this, DeepSpeed settings are reported as ignored and FSDP1's set the fsdp1 engine")
    box.button("Apply these files", key="w_import_apply", disabled=not files, on_click=_import, args=(files, engine))


def _import(files, engine_torch: bool) -> None:
    ss = st.session_state
    model = ss.w_preset if ss.w_source != SOURCE_HUB else (ss.w_hub.strip() or ss.w_preset)
    current = widgets.inputs_from_state(ss, model, "")
    try:
        inputs, notes = importbox.imported_inputs([(f.getvalue(), f.name) for f in files], engine_torch, current)
    except InputError as err:
        ss.notes, ss.link_warnings = [f"Import: {err}"], []
        return
    ss.update({k: v for k, v in widgets.state_from_inputs(inputs).items() if k != "w_upload"})
    if inputs.model != model and inputs.model in [p.name for p in cache.presets()]:
        ss.w_source, ss.w_preset = SOURCE_PRESET, inputs.model
    ss.notes, ss.link_warnings = [f"Imported {', '.join(f.name for f in files)}:", *notes], []


def _inputs(model: str, upload: str) -> share.AppInputs:
    return widgets.inputs_from_state(st.session_state, model, upload)


def _compute(model: str, upload: str, spec, spec_key: str, origin: str, title: str) -> results.Result:
    """The answer for the widgets' inputs; InputError names the field a refused combination blames."""
    if spec is None:
        share.check_model_name(model)
        spec, origin = cache.spec_for_model(model)
        spec_key = f"model:{model}"
    inputs = _inputs(model, upload)
    gpu = get_gpu(inputs.gpu_type)
    # one GPU, or one strategy: the table has the plan's offload and loss (rows that refuse them drop out);
    # "compare all" on several GPUs varies the strategy without what it leaves out (`share.compared`: offload, the
    # fused loss; `edits` picks a strategy when they are set)
    plan = share.compared(inputs).to_plan()
    comparison = cache.compare(spec_key, cache.plan_key(plan), gpu.memory_bytes, inputs.methods, spec, plan)
    own = [r for r in comparison.rows if not r.variant]
    valid = {f"{r.tp}:{r.zero}": r for r in own}
    note = "" if inputs.compare_all else edits.strategy_or_all(st.session_state, valid)
    if note:
        st.session_state.notes = [*st.session_state.get("notes", []), f"Adjusted: {note}"]
        inputs = _inputs(model, upload)
    if inputs.compare_all:
        row = comparison.recommended or min(own, key=lambda r: r.device_total_bytes)
    else:
        row = valid[f"{inputs.tp}:{inputs.zero}"]
    return results.Result(spec_key, spec, title, origin, inputs, gpu, comparison, row)


def _strategy_options(result) -> dict:
    options = {ALL: "Compare all — show the recommended"}
    rows = result.comparison.rows if result else ()
    for row in rows:
        if not row.variant:  # other methods' rows are shown in the table, not chosen here
            options[f"{row.tp}:{row.zero}"] = f"{row.label} (TP {row.tp}, ZeRO {row.zero})"
    current = st.session_state.get("w_strategy", ALL)
    if current not in options:  # no answer to list the strategies from: keep the choice as it is
        options[current] = "TP {}, ZeRO {}".format(*current.split(":"))
    return options


def _draw(name: str, box, errors: dict, strategies: dict) -> None:
    """One input of the sidebar, with the message of a refused combination under it."""
    ss = st.session_state
    if name == "gpu_type":
        gpus = {g.key: g for g in list_gpus()}
        box.selectbox("GPU type", list(gpus), key="w_gpu", help=HELP["gpu-type"], on_change=_edited, args=("w_gpu",),
                      format_func=lambda k: f"{gpus[k].name} ({format_gib(gpus[k].memory_bytes)})")
        key = "w_gpu"
    elif name == "zero":
        box.selectbox("Strategy", list(strategies), key="w_strategy", format_func=strategies.get, help=HELP["zero"],
                      on_change=_edited, args=("w_strategy",))
        key = "w_strategy"
    elif name == "methods":
        box.multiselect("Also compare methods", list(METHOD_VARIANTS), key="w_methods", help=HELP["methods"],
                        on_change=_edited, args=("w_methods",))
        key = "w_methods"
    else:
        option = BY_NAME[name]
        args = widgets.widget_args(option, ss)
        key = option.widget.key
        draw = {SELECT: box.selectbox, NUMBER: box.number_input, TEXT: box.text_input, CHECK: box.checkbox}
        draw[option.widget.kind](**args, on_change=_edited, args=(key,))
        error = widgets.text_error(option, ss) if option.widget.kind == TEXT else ""
        if error and not args["disabled"]:
            box.error(plain(error))
    if key in errors:
        box.error(errors[key])


def _sidebar(errors: dict, strategies: dict) -> None:
    """Every input but the model's, grouped (`edits.GROUPS`); a group opens when it holds an error or a change."""
    for title, names in edits.GROUPS[1:]:
        keys = {edits.widget_for(BY_NAME[n].key) for n in names if n in BY_NAME}
        opened = title in OPEN_GROUPS or bool(keys & set(errors)) or edits.differs_from_default(st.session_state,
                                                                                                 names)
        box = st.sidebar.expander(title, expanded=opened)
        for name in names:
            _draw(name, box, errors, strategies)


def _sync_url(inputs: share.AppInputs) -> str:
    """Write the inputs into the address bar (only when they changed) and return the share link."""
    query = share.encode(inputs)
    if st.query_params.to_dict() != query:
        st.query_params.from_dict(query)
    written = st.session_state.setdefault("written", [])
    if _query_key(query) not in written:
        written[:] = [*written[-63:], _query_key(query)]
    base = st.context.url or "http://localhost:8501/"
    return f"{base}?{urlencode(query)}"


def _messages() -> None:
    """The notes of the last edit (what it fixed) and a link's warnings: each once, in one box."""
    notes = st.session_state.get("notes", [])
    if notes:
        st.info("  \n".join(plain(n) for n in notes))
    warnings = st.session_state.get("link_warnings", [])
    if warnings:
        with st.expander(f"⚠️ Share link: {len(warnings)} value(s) changed — they go away at your next edit",
                         expanded=len(warnings) <= 3):
            listed = "\n".join(f"- {plain(edits.app_words(w))}" for w in warnings)
            st.warning(f"Share link: values this app could not use\n\n{listed}")


# ---------------------------------------------------------------- the page

def main() -> None:
    started, cpu = time.perf_counter(), time.thread_time()  # CPU: this script's own, whatever else the machine runs
    st.set_page_config(page_title="llmem — GPU memory for LLM fine-tuning", page_icon="🧮", layout="wide")
    st.html(REPLACE_HISTORY + results.STALE_CSS + results.CHARTS_CSS + UPLOAD_CSS + PHONE_CSS + results.PHONE_BAR_CSS,
            unsafe_allow_javascript=True)
    st.title("llmem: will it fit?")
    st.caption("Per-GPU memory to fine-tune an LLM under each distributed strategy, before you rent the GPU. "
               "All memory in GiB (2^30 bytes); parameter counts in SI (B = 10^9).")
    _init_from_url()
    _restore_widgets()
    ss = st.session_state
    model_box = st.sidebar.expander("Model", expanded=True)
    result, failure, model, upload = None, None, ss.w_preset, ""
    try:
        model, spec, origin, upload, spec_key, title = _model_widgets(model_box)
        result = _compute(model, upload, spec, spec_key, origin, title)
    except InputError as err:
        failure = err
    errors = {edits.widget_for(failure.field): plain(edits.app_words(str(failure)))} if failure else {}
    if "w_source" in errors:
        model_box.error(errors.pop("w_source"))
    _import_box()
    _sidebar(errors, _strategy_options(result))
    _remember_widgets()
    link = _sync_url(_inputs(model, upload))
    _messages()
    if result is not None:
        ss.last_good = result
        results.render(result, link, _apply)
        simulate.section(result.spec_key, result.row)
    else:
        st.warning(f"**Not a plan yet** — {plain(edits.app_words(str(failure)))}. The message is next to the field "
                   "in the sidebar" + ("; the last valid result stays below, greyed." if ss.get("last_good") else "."))
        results.phone_bar("Not a plan yet: the message is under the field it names", "none")
        if ss.get("last_good") is not None:
            with st.container(key="stale"):
                results.render(ss.last_good, link, _apply, stale=True)
    ss.last_render_ms, ss.last_render_cpu_ms = (time.perf_counter() - started) * 1000, (time.thread_time() - cpu) * 1000
    LOG.info("rendered in %.0f ms (%.0f ms CPU)", ss.last_render_ms, ss.last_render_cpu_ms)
    cache.settle_heap()  # after the page is drawn: the first page of a process pays for it, once


main()
