"""The app's answer for one valid set of inputs, drawn with streamlit: header, verdict, "Make it fit", the strategy
table with its CSV and Markdown exports, the breakdown and the curves. The numbers come from the library (through
`llmem.ui.cache`); this module only lays them out. A stale answer (the last valid one, kept while the inputs are
invalid) is drawn greyed, without its buttons."""

from __future__ import annotations

import html
from collections.abc import Callable
from dataclasses import dataclass

import streamlit as st
from plotly.basedatatypes import BaseFigure

from llmem import figures, share
from llmem.estimate import FITS, NO_FIT, RISK_FIX, RISKY
from llmem.ui import cache
from llmem.units import format_gib, format_params
from llmem.view import comparison_csv, comparison_markdown, comparison_table, export_name, plain

BATCH_POINTS, SEQ_POINTS = (1, 2, 4, 8, 16, 32, 64, 128, 256), tuple(256 << k for k in range(10))
STALE_CSS = "<style>.st-key-stale{opacity:.45;filter:grayscale(1);pointer-events:none}</style>"
# On a phone the inputs come below the results (app.PHONE_CSS): after an edit down there the verdict is a long scroll
# up, so a line at the foot of the screen repeats it (`phone_bar`), above the sidebar (z-index 999991); wider pages
# hide it.
PHONE_BAR_CSS = ("<style>.llmem-phone-verdict{display:none}@media (max-width:640px){.llmem-phone-verdict{display:block;"
                 "position:fixed;left:0;right:0;bottom:0;z-index:999995;padding:.45rem 1rem;font-size:.85rem;"
                 "line-height:1.3;border-top:1px solid rgba(0,0,0,.15);background:#f0f2f6;color:#31333f}"
                 ".llmem-fits{background:#dff3e4;color:#14532d}.llmem-risky{background:#fff4d6;color:#713f12}"
                 ".llmem-short{background:#fde2e2;color:#7f1d1d}"
                 "[data-testid='stSidebarContent']{padding-bottom:4rem}}</style>")
GRID_COLOURS = {FITS: "#dff3e4", RISKY: "#fff4d6", NO_FIT: "#fde2e2"}  # the verdict's colours, as on a phone's line
# The breakdown and the two curves side by side when the page has room; on a narrower one (a half-screen window) a
# chart that would get less than 300 px wraps to a row of its own instead of cutting its title and labels.
CHARTS_CSS = ("<style>.st-key-charts [data-testid='stHorizontalBlock']{flex-wrap:wrap}"
              ".st-key-charts [data-testid='stColumn']{min-width:min(100%,300px)}</style>")


class Checked(BaseFigure):
    """A breakdown or curve figure of `llmem.figures` (plain dicts; tests/test_figures.py validates them against
    plotly's schema) handed to `st.plotly_chart` as a figure object: streamlit then takes it as validated and only
    calls `to_dict`, instead of building and validating a plotly Figure property by property on every redraw
    (about a third of a redraw)."""

    def __init__(self, spec: dict):  # BaseFigure.__init__ is skipped on purpose: nothing else is read
        self._spec = spec

    def to_dict(self) -> dict:
        return self._spec


@dataclass(frozen=True)
class Result:
    """Everything one answer is drawn from."""

    spec_key: str
    spec: object
    title: str  # the model's name as the user chose it (preset and its id, Hugging Face id, uploaded file)
    origin: str
    inputs: share.AppInputs
    gpu: object
    comparison: object
    row: object  # the strategy shown: the chosen one, or the recommended under "compare all"

    @property
    def fits(self) -> bool:
        return self.row.fits

    def where(self) -> str:
        return f"{self.inputs.gpus}× {self.gpu.name}" if self.inputs.gpus > 1 else self.gpu.name


def _params_line(result: Result) -> str:
    from llmem.components.lora import total_params, trainable_params

    plan = result.row.plan
    total, trainable = total_params(result.spec, plan), trainable_params(result.spec, plan)
    share_text = "all of them trained" if trainable == total else f"{format_params(trainable)} trained"
    return (f"**{plain(result.title)}** — {format_params(total)} parameters, {share_text}; architecture "
            f"{plain(result.spec.model_type)}; config from {plain(result.origin)}")


def verdict_text(result: Result) -> str:
    row, where = result.row, result.where()
    text = f"{row.label}: {format_gib(row.device_total_bytes)} per GPU of {format_gib(result.gpu.memory_bytes)}"
    high = row.device_total_high_bytes
    if row.verdict == FITS:
        up_to = f" (up to {format_gib(high)})" if high > row.device_total_bytes else ""
        return f"**Fits on {where} with {format_gib(row.headroom_bytes)} to spare** per GPU — {text}{up_to}."
    if row.verdict == RISKY:
        return (f"**Fits on {where} only at the low end (risky)** — {text}, up to {format_gib(high)}: "
                f"{RISK_FIX}.")
    return f"**Short by {format_gib(abs(row.headroom_bytes))} per GPU on {where}** — {text}."


def phone_bar(text: str, kind: str) -> None:
    """The verdict again, in one line at the foot of a phone's screen (`PHONE_BAR_CSS`; kind: fits, risky, short or
    none)."""
    st.html(f"<div class='llmem-phone-verdict llmem-{kind}'>{html.escape(text)}</div>")


def _short_verdict(result: Result) -> tuple[str, str]:
    row = result.row
    if row.verdict == FITS:
        head, kind = f"Fits with {format_gib(row.headroom_bytes)} to spare", "fits"
    elif row.verdict == RISKY:
        head, kind = "Fits only at the low end (risky)", "risky"
    else:
        head, kind = f"Short by {format_gib(abs(row.headroom_bytes))}", "short"
    return f"{head} per GPU · {result.where()} · {row.label}", kind


def _verdict(result: Result, stale: bool) -> None:
    text = verdict_text(result)
    if stale:
        st.markdown(f"Last valid result: {text}")
        return
    {FITS: st.success, RISKY: st.warning}.get(result.row.verdict, st.error)(text)
    phone_bar(*_short_verdict(result))
    comparison, rec = result.comparison, result.comparison.recommended
    if rec is not None and (rec.tp, rec.zero) != (result.row.tp, result.row.zero):
        st.info(f"**Recommended instead: {rec.label}** (TP {rec.tp}, ZeRO {rec.zero}) — {comparison.reason}")
    else:
        st.caption(f"Recommended: {comparison.reason}" if rec is not None else comparison.reason)


def make_fit_panel(result: Result, apply: Callable) -> None:
    """The cheapest single changes that fit, each with its new device total and a button that applies it."""
    plan = result.row.plan
    fixes, fewest = cache.make_fit(result.spec_key, cache.plan_key(plan), result.inputs.gpu_type,
                                   result.inputs.compare_all, result.spec, plan)
    st.subheader("Make it fit")
    if not fixes:
        st.warning("No single change fits: try two (e.g. LoRA with more GPUs), or a smaller model.")
    else:
        st.caption("The cheapest single changes that fit, cheapest first, each with its new per-GPU total "
                   "(risky: it fits at the low end only, as the verdict says); **Apply** sets the inputs (the link "
                   "follows).")
    for i, fix in enumerate(fixes):
        left, middle, right = st.columns([4, 4, 1], vertical_alignment="center")
        left.markdown(f"**{fix.kind}**: {plain(fix.label)}  \n{plain(fix.cost)}")
        risky = (f"  \n**risky**: up to {format_gib(fix.device_total_high_bytes)} at the high end"
                 if fix.verdict == RISKY else "")
        middle.markdown(f"{format_gib(fix.device_total_bytes)} per GPU of {format_gib(fix.capacity_bytes)} "
                        f"({format_gib(fix.headroom_bytes)} to spare; peak {format_gib(fix.peak_bytes)}){risky}")
        right.button("Apply", key=f"fix_{i}", on_click=apply, args=(fix,), help=f"apply: {fix.label}")
    if fewest:
        n, fit_plan, est = fewest
        risky = est.verdict(result.gpu.memory_bytes) == RISKY
        st.markdown(f"Fewest **{plain(result.gpu.name)}** that fit this plan: **{n}** ({fit_plan.strategy_label}"
                    f"{f', TP={fit_plan.tp}' if fit_plan.tp > 1 else ''}; {format_gib(est.device_total_bytes)} "
                    "per GPU" + (f", risky: up to {format_gib(est.device_total_bytes_range[1])} at the high end"
                                 if risky else "") + ").")
    else:
        st.markdown(f"No count of **{plain(result.gpu.name)}** fits this plan (up to 4096).")


def _grid(result: Result) -> None:
    """On demand (its cold estimates, one set per GPU count, cost more than a redraw): headroom per GPU type and
    count, each cell coloured by its verdict."""
    import pandas as pd

    from llmem.gpus import list_gpus

    if not st.toggle("GPU type × GPU count grid (headroom per GPU)", key="w_grid"):
        return
    rows = cache.fit_grid(result.spec_key, cache.plan_key(result.row.plan), result.spec, result.row.plan)
    gpus = list_gpus()
    columns = {f"{r['gpus']} GPU{'s' if r['gpus'] > 1 else ''}": r for r in rows}
    headroom = pd.DataFrame({c: [round(r["headroom"][g.key] / 2**30, 2) for g in gpus] for c, r in columns.items()})
    colours = pd.DataFrame({c: [f"background-color: {GRID_COLOURS[r['verdict'][g.key]]}" for g in gpus]
                            for c, r in columns.items()})
    frame = pd.concat([pd.DataFrame({"GPU type": [g.name for g in gpus]}), headroom], axis=1)
    st.dataframe(frame.style.apply(lambda _: colours, axis=None, subset=list(columns)).format(precision=2),
                 hide_index=True)
    st.caption("GiB to spare per GPU (negative: short) with each count's best strategy (the smallest per-GPU total) "
               "for this model and plan; green fits, amber is risky (fits at the low end only), red is short. The "
               "estimate does not depend on the GPU type, only the fit does.")


def _table(result: Result, link: str, stale: bool) -> None:
    inputs = result.inputs
    st.subheader(f"Strategies on {inputs.gpus} GPU(s) of {result.gpu.name}")
    table = comparison_table(result.comparison)
    st.table(table.set_index("strategy").style.format(precision=2))
    st.caption("per-GPU peak = largest allocated tensor memory per GPU (torch max_memory_allocated); device total adds "
               "fragmentation and the CUDA context (what nvidia-smi shows); headroom = GPU memory − device total; "
               "high end = the caching allocator's rules for a model built in full on the GPU; fits = yes at the high "
               "end, risky at the low end only; "
               "max micro-batch = largest micro-batch per GPU that fits (0: none); tokens/step = micro-batch × "
               "grad-accum × sequence length × data-parallel ranks (0 where it does not fit).")
    if stale:
        return
    csv_col, md_col, link_col = st.columns([1, 1, 3])
    csv_col.download_button("Download CSV", comparison_csv(table, inputs, link, result.spec),
                            file_name=export_name(inputs, "csv"), mime="text/csv", key="csv",
                            help='The table, then the inputs as "#" lines: pandas.read_csv(path, comment="#").')
    md_col.download_button("Download Markdown", comparison_markdown(table, inputs, link, result.title,
                                                                    verdict_text(result)),
                           file_name=export_name(inputs, "md"), mime="text/markdown", key="markdown")
    with link_col:
        st.markdown("**Share link** — the address bar is always this link:")
        st.code(link, language=None, wrap_lines=True)


def _curves(result: Result, left, right) -> None:
    row, spec, key = result.row, result.spec, result.spec_key
    plan, cap = row.plan, result.gpu.memory_bytes
    unit = plan.microbatches if plan.pp > 1 else 1  # --pp: the step batch is M microbatches of equal size
    batches = sorted({b * unit for b in BATCH_POINTS if b * unit * plan.seq_len <= share.MAX_TOKENS}
                     | {plan.batch_size})
    seqs = sorted({s for s in SEQ_POINTS if s * plan.batch_size <= share.MAX_TOKENS} | {plan.seq_len})
    by_batch = [cache.estimate(key, cache.plan_key(p), spec, p) for p in (plan.with_(batch_size=b) for b in batches)]
    left.plotly_chart(Checked(figures.curve_figure(batches, by_batch, cap, f"vs micro-batch (seq-len {plan.seq_len})",
                                                   "micro-batch per GPU", row.max_batch_size or None,
                                                   plan.batch_size)), key="curve_batch")
    by_seq = [cache.estimate(key, cache.plan_key(p), spec, p) for p in (plan.with_(seq_len=s) for s in seqs)]
    fitting = [s for s, e in zip(seqs, by_seq, strict=True) if e.device_total_bytes <= cap]
    right.plotly_chart(Checked(figures.curve_figure(seqs, by_seq, cap, f"vs sequence length (batch {plan.batch_size})",
                                                    "sequence length (tokens)", max(fitting) if fitting else None,
                                                    plan.seq_len)), key="curve_seq")
    right.caption("Largest fitting micro-batch: from the strategy search. Largest fitting sequence length: the "
                  "largest plotted point whose device total is within the GPU's memory. ◇ marks the current value.")


def render(result: Result, link: str, apply: Callable, stale: bool = False) -> None:
    """The whole answer; `stale`: the last valid one, greyed, while the current inputs are refused."""
    st.markdown(_params_line(result))
    _verdict(result, stale)
    if not stale and not result.fits:
        make_fit_panel(result, apply)
    _table(result, link, stale)
    if not stale:
        _grid(result)
    est = result.row.estimate
    if est.host_bytes:
        st.caption(f"Offload: host memory {format_gib(est.host_bytes)} per rank, {format_gib(est.host_node_bytes)} "
                   "per node (not in the GPU figures).")
    if est.stage_peaks:  # --pp: the figures above are the worst stage's
        runs = "GPU i runs stages i, i + pp, ..." if str(est.plan.pp_schedule) == "interleaved-1f1b" else \
            "GPU i runs stage i"
        if est.plan.dp > 1:  # torchtitan's mesh: pp outer, the stage's data-parallel replicas neighbours
            runs = f"stage i on GPUs {est.plan.dp}·i .. {est.plan.dp}·i + {est.plan.dp - 1}"
        st.caption(f"Pipeline GPUs ({runs}): "
                   + ", ".join(f"{i}: {format_gib(b)}" for i, b in enumerate(est.stage_peaks))
                   + "; the verdict and the breakdown are the worst stage's.")
    st.subheader(f"{result.row.label}: breakdown and curves")
    left, middle, right = st.container(key="charts").columns(3)
    with left:
        st.plotly_chart(Checked(figures.breakdown_figure(est, result.gpu)), key="breakdown")
        st.caption(f"Peak phase: **{est.peak_phase}**. The stacked categories sum to the allocator peak "
                   f"({format_gib(est.peak_bytes)}); hatched items are outside it and only count toward the "
                   f"device total ({format_gib(est.device_total_bytes)}).")
    if not stale:
        for note in est.notes:
            st.warning(plain(note))
    _curves(result, middle, right)
