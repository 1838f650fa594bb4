"""The app's "Simulate this step" section (`llmem.simulate`), drawn with streamlit: a button runs the shown
strategy's real training step on fake tensors; the result is kept per (model, plan) for the session."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from llmem import figures
from llmem.errors import InputError
from llmem.ui import cache
from llmem.units import format_gib
from llmem.view import plain


def _step_config(spec_key: str) -> dict:
    """The config.json dict the spec came from: a preset / Hugging Face id, or this session's upload."""
    if spec_key.startswith("upload:"):
        from llmem.sources import config_from_bytes

        upload = st.session_state.get("w_upload")
        if upload is None:
            raise InputError("model", "the uploaded config is gone from this session; upload it again")
        parsed = config_from_bytes(upload.getvalue(), upload.name)
        return getattr(parsed, "config", parsed)
    return cache.config_for_model(spec_key.removeprefix("model:"))


def _run(spec_key: str, row, key, sims: dict) -> bool:
    from llmem.simulate import simulate

    with st.status("Simulating…", expanded=False) as status:
        try:
            sims[key] = simulate(_step_config(spec_key), row.plan,
                                 progress=lambda text: status.update(label=f"Simulating: {text}"))
        except InputError as err:
            status.update(label="This step cannot be simulated", state="error")
            st.error(plain(err))
            return False
        status.update(label=f"Simulated in {sims[key].seconds:.1f} s ({sims[key].ops:,} ops)", state="complete")
    return True


def section(spec_key: str, row) -> None:
    st.subheader("Simulate this step")
    st.caption("Runs this strategy's real training step (transformers + PyTorch, two iterations, one rank) on fake "
               "tensors — no memory is allocated — and records every allocation: the exact peak, when it happens, "
               "which tensors make it, and what the CUDA caching allocator would reserve. Takes seconds for small "
               "models, up to a minute for 70B-class ones.")
    key = (spec_key, cache.plan_key(row.plan))
    sims = st.session_state.setdefault("simulations", {})
    if st.button("Simulate this step", key="simulate") and not _run(spec_key, row, key, sims):
        return
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
