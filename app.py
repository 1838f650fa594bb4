"""llmem web app: widgets -> TrainingPlan -> llmem.estimate / llmem.compare -> verdict, charts, table.

Run with `streamlit run app.py`. Every input lives in the URL query string (`llmem.share`), so the address bar is
always a link that reopens the same view. No memory arithmetic happens here: the numbers come from the library;
this file only chooses what to show and converts bytes to GiB for the axes.
"""

from __future__ import annotations

import hashlib
import time
from urllib.parse import urlencode

import pandas as pd
import streamlit as st

from llmem import figures, share, widgets
from llmem.compare import METHOD_VARIANTS
from llmem.errors import InputError
from llmem.gpus import get_gpu, list_gpus
from llmem.help import HELP
from llmem.options import CHECK, NUMBER, SELECT, TEXT
from llmem.plan import Loss, Offload, TrainingPlan
from llmem.units import format_gib, format_params
from llmem.view import comparison_csv, comparison_table, plain

WIDGET_KEYS = ("w_source", *widgets.WIDGET_KEYS)
SOURCE_PRESET, SOURCE_HUB, SOURCE_UPLOAD = "Preset", "Hugging Face id", "Upload config.json"
BATCH_POINTS, SEQ_POINTS = (1, 2, 4, 8, 16, 32, 64, 128, 256), tuple(256 << k for k in range(10))
PRESET_LABEL = {"yes": "", "derived": " (traced from transformers on first use)", "not yet": " (not modelled yet)"}
TRACING = "Estimating… an architecture outside the hand-written families is traced from transformers on first use"


# ---------------------------------------------------------------- library calls, cached per process

@st.cache_resource(show_spinner=False)
def _presets() -> list:
    from llmem.presets import list_presets

    return list_presets()


@st.cache_resource(show_spinner=False, max_entries=64)
def _spec_for_model(model: str):
    """(ModelSpec, origin) for a preset name or Hugging Face id; InputError is not cached, so a retry refetches."""
    from llmem.sources import resolve_model
    from llmem.spec import modelled_spec

    share.check_model_name(model)  # never let the app open a server path, whatever the caller passed
    source = resolve_model(model)
    return modelled_spec(source.config), source.origin


@st.cache_resource(show_spinner=False, max_entries=16)
def _spec_for_upload(digest: str, _data: bytes, name: str):
    from llmem.sources import config_from_bytes
    from llmem.spec import modelled_spec

    parsed = config_from_bytes(_data, name)
    config = getattr(parsed, "config", parsed)  # ModelSource or plain dict
    return modelled_spec(config), f"uploaded {name}"


def _plan_key(plan: TrainingPlan) -> str:
    """A cheap cache key for a plan (hashing a short string beats hashing a tuple of pairs)."""
    return repr(sorted(plan.to_dict().items()))


@st.cache_resource(show_spinner=False, max_entries=2048)
def _estimate(spec_key: str, plan_key: str, _spec, _plan: TrainingPlan):
    from llmem.estimate import estimate

    return estimate(_spec, _plan)


@st.cache_resource(show_spinner=TRACING, max_entries=256)  # shown after 0.5 s: a first trace, not a cache miss
def _compare(spec_key: str, plan_key: str, capacity: int, methods: str, _spec, _plan: TrainingPlan):
    from llmem.compare import compare, method_variants

    return compare(_spec, _plan, capacity, variants=method_variants(methods))


# ---------------------------------------------------------------- inputs: URL <-> widgets

def _defaults() -> share.AppInputs:
    names = [p.name for p in _presets()]
    model = share.AppInputs().model
    return share.AppInputs(model=model if model in names or not names else names[0])


def _init_from_url() -> None:
    """First run of a session: put the link's values into the widgets and keep the warnings to show."""
    if "w_source" in st.session_state:
        return
    defaults = _defaults()
    inputs, warnings = share.decode(st.query_params.to_dict(), defaults)
    if inputs.upload:
        warnings.append(f"upload: this link was made from an uploaded config ({inputs.upload}), which cannot travel "
                        f"in a URL; showing {inputs.model} instead. Upload the file again, or share a preset or "
                        "Hugging Face id")
    preset_names = [p.name for p in _presets()]
    ss = st.session_state
    ss.w_source = SOURCE_PRESET if inputs.model in preset_names else SOURCE_HUB
    ss.w_preset = inputs.model if inputs.model in preset_names else defaults.model
    ss.w_hub = "" if inputs.model in preset_names else inputs.model
    ss.update(widgets.state_from_inputs(inputs))
    if ss.w_source == SOURCE_HUB:
        try:  # a link's model that cannot be loaded (offline, gated, unknown) opens the default preset instead
            _spec_for_model(inputs.model)
        except InputError as err:
            warnings.append(f"{err}; showing {defaults.model} instead")
            ss.w_source, ss.w_hub = SOURCE_PRESET, ""
    ss.link_warnings = warnings


def _restore_widgets() -> None:
    """Streamlit forgets the value of a widget that a run did not draw (the preset box while an id is typed);
    keep a copy so that switching back, or an error that stops the page early, loses nothing."""
    for key, value in st.session_state.get("kept", {}).items():
        if key not in st.session_state:
            st.session_state[key] = value


def _remember_widgets() -> None:
    st.session_state.kept = {k: st.session_state[k] for k in WIDGET_KEYS if k in st.session_state}


def _model_widgets():
    """The model inputs: (model for the link, spec or None, origin, upload name, cache key of the spec)."""
    sb = st.sidebar
    source = sb.radio("Model", (SOURCE_PRESET, SOURCE_HUB, SOURCE_UPLOAD), key="w_source", horizontal=False,
                      help=HELP["model"])
    presets = {p.name: p for p in _presets()}
    if st.session_state.w_preset not in presets and presets:
        st.session_state.w_preset = next(iter(presets))
    if source == SOURCE_PRESET:
        sb.selectbox("Preset (type to search)", list(presets), key="w_preset",
                     format_func=lambda n: f"{n} — {presets[n].hf_id}"
                                           + PRESET_LABEL[presets[n].estimator])
        return st.session_state.w_preset, None, None, "", ""
    if source == SOURCE_HUB:
        sb.text_input("Hugging Face model id", key="w_hub", placeholder="org/name, e.g. Qwen/Qwen2.5-7B",
                      help="Only the model's config.json is fetched (needs network; gated models need HF_TOKEN). "
                           "Remote code is never run.")
        return (st.session_state.w_hub.strip() or st.session_state.w_preset), None, None, "", ""
    upload = sb.file_uploader("config.json", type=["json"], key="w_upload",
                              help="A Hugging Face config.json (at most 256 KiB). It stays in this session only.")
    sb.info("An uploaded config can't travel in a share link: the link keeps only its file name. "
            "To share, pick the matching preset or use its Hugging Face id.")
    if upload is None:
        return st.session_state.w_preset, None, None, "", ""
    data = upload.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    spec, origin = _spec_for_upload(digest, data, upload.name)
    return st.session_state.w_preset, spec, origin, upload.name, f"upload:{digest}"


def _training_widgets() -> None:
    """The GPU type, then one widget per option of the table (`llmem.widgets`), then the methods to compare."""
    sb = st.sidebar
    gpus = {g.key: g for g in list_gpus()}
    sb.selectbox("GPU type", list(gpus), key="w_gpu", help=HELP["gpu-type"],
                 format_func=lambda k: f"{gpus[k].name} ({format_gib(gpus[k].memory_bytes)})")
    draw = {SELECT: sb.selectbox, NUMBER: sb.number_input, TEXT: sb.text_input, CHECK: sb.checkbox}
    for option in widgets.TABLE_WIDGETS:
        args = widgets.widget_args(option, st.session_state)
        on_change = _method_changed if option.name == "method" else None
        draw[option.widget.kind](**args, on_change=on_change)
        error = widgets.text_error(option, st.session_state) if option.widget.kind == TEXT else ""
        if error and not args["disabled"]:
            sb.error(plain(error))
    sb.multiselect("Also compare methods", list(METHOD_VARIANTS), key="w_methods", help=HELP["methods"])


def _method_changed() -> None:
    widgets.method_changed(st.session_state)


def _inputs(model: str, upload: str) -> share.AppInputs:
    return widgets.inputs_from_state(st.session_state, model, upload)


def _sync_url(inputs: share.AppInputs) -> str:
    """Write the inputs into the address bar (only when they changed) and return the share link."""
    query = share.encode(inputs)
    if st.query_params.to_dict() != query:
        st.query_params.from_dict(query)
    base = st.context.url or "http://localhost:8501/"
    return f"{base}?{urlencode(query)}"


def _strategy_widget(comparison) -> None:
    """The strategy choice: compare all (and show the recommended one) or one valid (TP, ZeRO) row."""
    options = {"all": "Compare all — show the recommended"}
    for row in comparison.rows:
        if not row.variant:  # other methods' rows are shown in the table, not chosen here
            options[f"{row.tp}:{row.zero}"] = f"{row.label} (TP {row.tp}, ZeRO {row.zero})"
    if st.session_state.get("w_strategy") not in options:
        wanted = st.session_state.get("w_strategy")
        st.session_state.w_strategy = "all"
        if wanted:
            st.warning(f"strategy: TP {wanted.replace(':', ', ZeRO ')} is not valid for this model on "
                       f"{st.session_state.w_gpus} GPU(s); comparing all strategies instead.")
    st.sidebar.selectbox("Strategy", list(options), key="w_strategy", format_func=options.get,
                         help=HELP["zero"])


# ---------------------------------------------------------------- rendering

def _verdict(row, gpu, gpus: int, comparison, compare_all: bool) -> None:
    where = f"{gpus}× {gpu.name}" if gpus > 1 else gpu.name
    text = (f"{row.label}: {format_gib(row.device_total_bytes)} per GPU of {format_gib(gpu.memory_bytes)}")
    if row.fits:
        st.success(f"**Fits on {where} with {format_gib(row.headroom_bytes)} to spare** per GPU — {text}.")
    else:
        st.error(f"**Short by {format_gib(abs(row.headroom_bytes))} per GPU on {where}** — {text}.")
    rec = comparison.recommended
    if rec is not None:
        lead = "Recommended" if compare_all or (rec.tp, rec.zero) == (row.tp, row.zero) else "Recommended instead"
        st.info(f"**{lead}: {rec.label}** (TP {rec.tp}, ZeRO {rec.zero}) — {comparison.reason}")
    else:
        st.warning(f"**No strategy fits on {where}.** {comparison.reason}")


def _curves(spec_key: str, spec, row, gpu, left, right) -> None:
    plan = row.plan
    cap = gpu.memory_bytes
    batches = sorted({b for b in BATCH_POINTS if b * plan.seq_len <= share.MAX_TOKENS} | {plan.batch_size})
    seqs = sorted({s for s in SEQ_POINTS if s * plan.batch_size <= share.MAX_TOKENS} | {plan.seq_len})
    by_batch = [_estimate(spec_key, _plan_key(p), spec, p) for p in (plan.with_(batch_size=b) for b in batches)]
    largest_batch = row.max_batch_size or None
    left.plotly_chart(figures.curve_figure(batches, by_batch, cap, f"vs micro-batch (seq-len {plan.seq_len})",
                                    "micro-batch per GPU", largest_batch), key="curve_batch")
    by_seq = [_estimate(spec_key, _plan_key(p), spec, p) for p in (plan.with_(seq_len=s) for s in seqs)]
    fitting = [s for s, e in zip(seqs, by_seq, strict=True) if e.device_total_bytes <= cap]
    right.plotly_chart(figures.curve_figure(seqs, by_seq, cap, f"vs sequence length (batch {plan.batch_size})",
                                     "sequence length (tokens)", max(fitting) if fitting else None),
                       key="curve_seq")
    right.caption("Largest fitting micro-batch: from the strategy search. Largest fitting sequence length: the "
                  "largest plotted point whose device total is within the GPU's memory.")


# ---------------------------------------------------------------- the page

def main() -> None:
    started = time.perf_counter()
    st.set_page_config(page_title="llmem — GPU memory for LLM fine-tuning", page_icon="🧮", layout="wide")
    st.title("llmem: will it fit?")
    st.caption("Per-GPU memory to fine-tune an LLM under each distributed strategy, before you rent the GPU. "
               "All memory in GiB (2^30 bytes); parameter counts in SI (B = 10^9).")
    _init_from_url()
    _restore_widgets()
    for message in st.session_state.get("link_warnings", []):
        st.warning(f"Share link: {plain(message)}")

    try:
        model, spec, origin, upload, spec_key = _model_widgets()
    except InputError as err:
        model = st.session_state.w_preset
        st.error(plain(err))
        _training_widgets()
        _remember_widgets()
        _sync_url(_inputs(model, ""))
        st.stop()
    _training_widgets()
    _remember_widgets()
    inputs = _inputs(model, upload)

    try:
        if spec is None:
            share.check_model_name(model)
            spec, origin = _spec_for_model(model)
            spec_key = f"model:{model}"
        gpu = get_gpu(inputs.gpu_type)
        # the comparison varies the strategy: options valid for some strategies only are left out of it
        base = inputs.with_(zero=share.ALL, offload=Offload.NONE,
                            loss=inputs.loss if inputs.gpus == 1 else Loss.STANDARD).to_plan()
        comparison = _compare(spec_key, _plan_key(base), gpu.memory_bytes, inputs.methods, spec, base)
        _strategy_widget(comparison)
        _remember_widgets()
        inputs = _inputs(model, upload)
        link = _sync_url(inputs)
        _render(spec_key, spec, origin, inputs, gpu, comparison, link)
    except InputError as err:
        _sync_url(inputs)
        st.error(plain(err))
        st.stop()
    st.session_state.last_render_ms = (time.perf_counter() - started) * 1000
    st.caption(f"Rendered in {st.session_state.last_render_ms:.0f} ms.")


def _render(spec_key: str, spec, origin: str, inputs: share.AppInputs, gpu, comparison, link: str) -> None:
    st.markdown(f"**{plain(spec.name)}** ({plain(spec.model_type)}) — {format_params(spec.total_params)} "
                f"parameters ({format_params(spec.trainable_params)} trainable); config from {plain(origin)}")
    own = [r for r in comparison.rows if not r.variant]
    if inputs.compare_all:
        row = comparison.recommended or min(own, key=lambda r: r.device_total_bytes)
    else:
        row = next(r for r in own if (r.tp, r.zero) == (inputs.tp, inputs.zero))
    _verdict(row, gpu, inputs.gpus, comparison, inputs.compare_all)

    st.subheader(f"Strategies on {inputs.gpus} GPU(s) of {gpu.name}")
    table = comparison_table(comparison)
    st.table(table.set_index("strategy").style.format(precision=2))
    st.caption("per-GPU peak = largest allocated tensor memory per GPU (torch max_memory_allocated); device total adds "
               "fragmentation and the CUDA context (what nvidia-smi shows); headroom = GPU memory − device total; "
               "max micro-batch = largest micro-batch per GPU that fits (0: none).")
    csv_col, link_col = st.columns([1, 3])
    csv_col.download_button("Download CSV (table + inputs)", comparison_csv(table, inputs, link, spec),
                            file_name="llmem-strategies.csv", mime="text/csv", key="csv")
    with link_col:
        st.markdown("**Share link** — the address bar is always this link; copy it with the icon at its right:")
        st.code(link, language=None, wrap_lines=True)

    est = _estimate(spec_key, _plan_key(row.plan), spec, row.plan)
    if not inputs.compare_all and (inputs.offload is not Offload.NONE or inputs.loss is not Loss.STANDARD):
        plan = inputs.to_plan()  # the table compares strategies without these options; the breakdown has them
        est = _estimate(spec_key, _plan_key(plan), spec, plan)
        st.caption(f"With --offload {inputs.offload} --loss {inputs.loss}: per-GPU peak {format_gib(est.peak_bytes)}"
                   + (f"; host memory {format_gib(est.host_bytes)} per rank, {format_gib(est.host_node_bytes)} "
                      "per node (not in the GPU figures)" if est.host_bytes else ""))
    st.subheader(f"{row.label}: breakdown and curves")
    left, middle, right = st.columns(3)
    with left:
        st.plotly_chart(figures.breakdown_figure(est, gpu), key="breakdown")
        st.caption(f"Peak phase: **{est.peak_phase}**. The stacked categories sum to the allocator peak "
                   f"({format_gib(est.peak_bytes)}); hatched items are outside it and only count toward the "
                   f"device total ({format_gib(est.device_total_bytes)}).")
    for note in est.notes:
        st.warning(plain(note))
    _curves(spec_key, spec, row, gpu, middle, right)
    _simulate_section(spec_key, row)


# ---------------------------------------------------------------- simulate this step (llmem.simulate)

@st.cache_resource(show_spinner=False, max_entries=32)
def _config_for_model(model: str) -> dict:
    from llmem.sources import resolve_model

    share.check_model_name(model)
    return resolve_model(model).config


def _step_config(spec_key: str) -> dict:
    """The config.json dict the spec came from: a preset / Hugging Face id, or this session's upload."""
    if spec_key.startswith("upload:"):
        from llmem.sources import config_from_bytes

        upload = st.session_state.get("w_upload")
        if upload is None:
            raise InputError("model", "the uploaded config is gone from this session; upload it again")
        parsed = config_from_bytes(upload.getvalue(), upload.name)
        return getattr(parsed, "config", parsed)
    return _config_for_model(spec_key.removeprefix("model:"))


def _simulate_section(spec_key: str, row) -> None:
    st.subheader("Simulate this step")
    st.caption("Runs this strategy's real training step (transformers + PyTorch, two iterations, one rank) on fake "
               "tensors — no memory is allocated — and records every allocation: the exact peak, when it happens, "
               "which tensors make it, and what the CUDA caching allocator would reserve. Takes seconds for small "
               "models, up to a minute for 70B-class ones.")
    key = (spec_key, _plan_key(row.plan))
    sims = st.session_state.setdefault("simulations", {})
    if st.button("Simulate this step", key="simulate"):
        from llmem.simulate import simulate

        with st.status("Simulating…", expanded=False) as status:
            try:
                sims[key] = simulate(_step_config(spec_key), row.plan,
                                     progress=lambda text: status.update(label=f"Simulating: {text}"))
            except InputError as err:
                status.update(label="This step cannot be simulated", state="error")
                st.error(plain(err))
                return
            status.update(label=f"Simulated in {sims[key].seconds:.1f} s ({sims[key].ops:,} ops)", state="complete")
    sim = sims.get(key)
    if sim is None:
        return
    est = row.estimate
    diff = est.peak_bytes - sim.peak_bytes
    cols = st.columns(4)
    cols[0].metric("simulated peak (allocated)", format_gib(sim.peak_bytes))
    cols[1].metric("closed-form estimate", format_gib(est.peak_bytes),
                   delta=f"{diff / sim.peak_bytes:+.2%} ({diff / 2**20:+,.1f} MiB) vs simulation", delta_color="off")
    cols[2].metric("predicted max_memory_reserved", format_gib(sim.reserved_bytes),
                   delta=f"fragmentation {format_gib(sim.fragmentation_bytes)}", delta_color="off")
    cols[3].metric("reserved with expandable_segments", format_gib(sim.reserved_expandable_bytes))
    st.plotly_chart(figures.timeline_figure(sim, est), key="sim_timeline")
    st.markdown(f"**Largest live tensors at the peak** ({sim.peak_phase}, iteration {sim.peak_iteration}):")
    st.dataframe(pd.DataFrame([{"MiB": round(t.nbytes / 2**20, 3), "shape": t.shape, "op": t.op, "module": t.module,
                                "allocated in": f"{t.phase} {t.iteration}",
                                "closed form": "yes" if t.closed_form else ""} for t in sim.top_tensors]),
                 hide_index=True)
    for line in [*sim.closed_form, *sim.notes]:
        st.caption(line)


main()
