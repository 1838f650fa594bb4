"""What the app shows besides charts, as plain data: user text made safe for Markdown, the comparison table, the CSV.

Streamlit renders the body of st.markdown / st.caption / st.error / st.warning / st.info as Markdown, so a
user-provided string (an uploaded config's `_name_or_path`, a file name, a typed or linked model id, any message
that quotes one) put there unescaped could become an image the viewer's browser fetches from anywhere. `plain`
escapes such a string so that it renders as the literal text. No Streamlit here: the app calls these.
"""

from __future__ import annotations

import re

import pandas as pd

from llmem import share
from llmem.estimate import FITS, NO_FIT, RISKY
from llmem.units import gib

# every ASCII punctuation character: CommonMark lets each be backslash-escaped, and an escaped one is literal text
_PUNCTUATION = re.compile(r"([!-/:-@\[-`{-~])")


def plain(text: object) -> str:
    """`text` as Markdown that renders as that text on one line (runs of whitespace as one space): no link, image,
    HTML tag, emphasis, heading, list, code block or span, math or Streamlit directive can come out of it."""
    return _PUNCTUATION.sub(r"\\\1", " ".join(str(text).split()))


_FITS = {FITS: "yes", RISKY: "risky", NO_FIT: "no"}  # the verdict at the high end of the device total


def comparison_table(comparison) -> pd.DataFrame:
    """One row per strategy (and per compared method), as the app's table and its CSV show it, the columns that
    decide first; fits is "risky" where only the low end of the device total fits. Tokens per step are the plan's:
    micro-batch × grad-accum × sequence length × data-parallel ranks, 0 on a row that does not fit. The host RAM
    column is there only when some row offloads."""
    rec = comparison.recommended
    rows = []
    for row in comparison.rows:
        plan = row.plan
        rows.append({  # what decides first (a phone shows the first few columns): fits, total, headroom
            "strategy": row.label,
            "fits": _FITS[row.verdict],
            "device total (GiB)": round(gib(row.device_total_bytes), 2),
            "headroom (GiB)": round(gib(row.headroom_bytes), 2),
            "device total, high end (GiB)": round(gib(row.device_total_high_bytes), 2),
            "per-GPU peak (GiB)": round(gib(row.peak_bytes), 2),
            "max micro-batch": row.max_batch_size,
            "tokens/step": plan.tokens_per_step * plan.grad_accum if row.fits else 0,
            "recommended": "yes" if rec is not None and plan == rec.plan else "no",
            "peak phase": row.estimate.peak_phase,
            "TP": row.tp,
            "ZeRO": row.zero,
            "host RAM per node (GiB)": round(gib(row.estimate.host_node_bytes), 2),
        })
    frame = pd.DataFrame(rows)
    if not frame.empty and not frame["host RAM per node (GiB)"].any():
        frame = frame.drop(columns="host RAM per node (GiB)")
    return frame


CSV_READ = 'pandas.read_csv(path, comment="#")'  # what reads the CSV back (docs/APP.md says so)


def comparison_csv(table: pd.DataFrame, inputs: share.AppInputs, link: str, spec) -> bytes:
    """The table exactly as shown, then `#` lines with the inputs that produced it: UTF-8 with a byte-order mark
    (spreadsheets then read × and · in the labels right), read back by `CSV_READ`."""
    lines = ["# llmem strategy comparison (GiB = 2^30 bytes; peak = max_memory_allocated per GPU)"]
    lines += [f"# {k}: {v}" for k, v in share.encode(inputs).items()]
    lines += [f"# parameters: {spec.total_params}", f"# link: {link}"]
    return (table.to_csv(index=False, lineterminator="\n") + "\n".join(lines) + "\n").encode("utf-8-sig")


def export_name(inputs: share.AppInputs, suffix: str) -> str:
    """A download's file name after the model, GPU type and count: llmem-llama-3.1-8b-8x-a100-80gb.csv."""
    model = re.sub(r"[^A-Za-z0-9._-]+", "_", inputs.upload or inputs.model).strip("._") or "model"
    return f"llmem-{model[:80]}-{inputs.gpus}x-{inputs.gpu_type}.{suffix}"


def _cell(value: object) -> str:
    return str(value).replace("|", "\\|")


def comparison_markdown(table: pd.DataFrame, inputs: share.AppInputs, link: str, title: str, verdict: str) -> str:
    """The verdict, the table and the inputs as Markdown, for meeting notes."""
    head = "| " + " | ".join(_cell(c) for c in table.columns) + " |"
    rule = "|" + "|".join("---:" if pd.api.types.is_numeric_dtype(table[c]) else "---" for c in table.columns) + "|"
    body = ["| " + " | ".join(_cell(v) for v in row) + " |" for row in table.itertuples(index=False)]
    inputs_lines = [f"- `{k}`: {_cell(v)}" for k, v in share.encode(inputs).items()]
    return "\n".join([f"# {title}", "", verdict, "", head, rule, *body, "",
                      "GiB = 2^30 bytes; per-GPU peak = torch max_memory_allocated; device total adds fragmentation "
                      "and the CUDA context.", "", "## Inputs", "", *inputs_lines, "", f"[Open in llmem]({link})", ""])
