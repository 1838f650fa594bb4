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
from llmem.units import gib

# every ASCII punctuation character: CommonMark lets each be backslash-escaped, and an escaped one is literal text
_PUNCTUATION = re.compile(r"([!-/:-@\[-`{-~])")


def plain(text: object) -> str:
    """`text` as Markdown that renders as that text on one line (runs of whitespace as one space): no link, image,
    HTML tag, emphasis, heading, list, code block or span, math or Streamlit directive can come out of it."""
    return _PUNCTUATION.sub(r"\\\1", " ".join(str(text).split()))


def comparison_table(comparison) -> pd.DataFrame:
    """One row per strategy (and per compared method), as the app's table and CSV show it."""
    rec = comparison.recommended
    rows = []
    for row in comparison.rows:
        rows.append({
            "strategy": row.label,
            "recommended": "★" if rec is not None and row.plan == rec.plan else "",
            "TP": row.tp,
            "ZeRO": row.zero,
            "per-GPU peak (GiB)": round(gib(row.peak_bytes), 2),
            "device total (GiB)": round(gib(row.device_total_bytes), 2),
            "fits": "yes" if row.fits else "no",
            "headroom (GiB)": round(gib(row.headroom_bytes), 2),
            "max micro-batch": row.max_batch_size,
            "tokens/step": row.tokens_per_step,
            "host RAM per node (GiB)": round(gib(row.estimate.host_node_bytes), 2),
        })
    return pd.DataFrame(rows)


def comparison_csv(table: pd.DataFrame, inputs: share.AppInputs, link: str, spec) -> str:
    """The table exactly as shown, after `#` comment lines with the inputs that produced it."""
    lines = ["# llmem strategy comparison (GiB = 2^30 bytes; peak = max_memory_allocated per GPU)"]
    lines += [f"# {k}: {v}" for k, v in share.encode(inputs).items()]
    lines += [f"# parameters: {spec.total_params}", f"# link: {link}"]
    return "\n".join(lines) + "\n" + table.to_csv(index=False)
