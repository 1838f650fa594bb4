"""Plotly figure specs for the app, as plain dicts (no plotly or streamlit import): the breakdown bar, the curves
against micro-batch and sequence length, the simulated timeline. Bytes come in; only the axes convert to GiB."""

from __future__ import annotations

import math

from llmem.units import format_gib, gib

# the breakdown's two bars, each label on two short lines: a narrow column never rotates or cuts them
ALLOCATOR, OUTSIDE = "allocator<br>peak", "outside the<br>allocator"
CATEGORY_COLORS = ("#4C78A8", "#F58518", "#E45756", "#72B7B2", "#54A24B", "#EECA3B", "#B279A2", "#9D755D")


def hline(y: float, text: str, color: str, dash: str) -> tuple[dict, dict]:
    """A horizontal line across the plot and its label (plain dicts: much faster than Figure.add_hline)."""
    shape = dict(type="line", xref="paper", x0=0, x1=1, y0=y, y1=y, line=dict(color=color, dash=dash))
    label = dict(xref="paper", x=0, y=y, text=text, showarrow=False, xanchor="left", yanchor="bottom",
                 font=dict(color=color, size=11))
    return shape, label


def breakdown_figure(est, gpu) -> dict:
    """Stacked bar of the allocator peak by category, each labelled with its size; the items outside the allocator in
    a hatched bar apart. Empty categories are left out (no legend entry for nothing)."""
    x = [ALLOCATOR]
    data = [dict(type="bar", name=str(category), x=x, y=[gib(n)], marker=dict(color=CATEGORY_COLORS[i % 8]),
                 text=[f"{gib(n):.2f}"], textposition="inside", insidetextanchor="middle",
                 hovertemplate=f"{category}: {format_gib(n)}<extra></extra>")
            for i, (category, n) in enumerate(est.breakdown.items()) if n > 0]
    outside = {"fragmentation allowance (outside the allocator peak)": est.fragmentation_bytes,
               "CUDA context (outside the allocator)": est.cuda_context_bytes}
    if est.paged_state_bytes:
        outside["paged optimizer states (unified memory, outside the allocator)"] = est.paged_state_bytes
    data += [dict(type="bar", name=name, x=[OUTSIDE], y=[gib(n)],
                  marker=dict(color="#BAB0AC", pattern=dict(shape="/")), text=[f"{gib(n):.2f}"],
                  textposition="inside", hovertemplate=f"{name}: {format_gib(n)}<extra></extra>")
             for name, n in outside.items() if n > 0]
    # the capacity's label over the right-hand bar (the items outside the allocator: a few GiB, always far below the
    # line), short enough to stay within that bar's half of the plot: the allocator's bar may cross the line
    shape, label = hline(gib(gpu.memory_bytes), f"GPU {format_gib(gpu.memory_bytes)}", "red", "dash")
    label |= dict(x=1, xanchor="right")
    top = max(gib(est.device_total_bytes), gib(gpu.memory_bytes)) * 1.08
    layout = dict(barmode="stack", height=520, margin=dict(l=10, r=10, t=40, b=10), shapes=[shape],
                  annotations=[label], title=dict(text=f"Peak {format_gib(est.peak_bytes)} in {est.peak_phase}"),
                  yaxis=dict(title=dict(text="GiB per GPU"), range=[0, top]), xaxis=dict(automargin=True, tickangle=0),
                  legend=dict(orientation="h", y=-0.2, traceorder="reversed"), uniformtext=dict(minsize=9,
                                                                                               mode="hide"))
    return dict(data=data, layout=layout)


def curve_figure(xs, ests, capacity: int, title: str, xlabel: str, largest, current=None) -> dict:
    """Allocator peak and device total against one input, with the capacity line, the largest fitting value and
    the current value marked. The y axis spans the capacity, the current point and the first point above the
    capacity (where the curve crosses it): the region a plan is decided in; steeper points run off the top."""
    totals = [gib(e.device_total_bytes) for e in ests]
    data = [dict(type="scatter", mode="lines+markers", x=list(xs), y=[gib(e.peak_bytes) for e in ests],
                 name="allocator peak"),
            dict(type="scatter", mode="lines+markers", x=list(xs), y=totals,
                 name="device total (+ context, fragmentation)")]
    if current is not None and current in xs:
        at = list(xs).index(current)
        data.append(dict(type="scatter", mode="markers", x=[current], y=[totals[at]], name=f"current: {current}",
                         marker=dict(color="black", size=12, symbol="diamond-open", line=dict(width=2))))
    shape, label = hline(gib(capacity), "capacity", "red", "dash")
    shapes, annotations = [shape], [label]
    if largest is not None:
        shapes.append(dict(type="line", yref="paper", y0=0, y1=1, x0=largest, x1=largest,
                           line=dict(color="green", dash="dot")))
        annotations.append(dict(yref="paper", y=1, x=math.log10(largest), text=f"largest fitting: {largest}",
                                showarrow=False, xanchor="left", yanchor="top", font=dict(color="green", size=11)))
    cap = gib(capacity)
    crossing = min((t for t in totals if t > cap), default=max(totals, default=0.0))
    current_total = totals[list(xs).index(current)] if current in xs else 0.0
    top = max(cap, crossing, current_total) * 1.15
    xs = list(xs)
    inside = [i for i, t in enumerate(totals) if t <= top] or [0]
    last = xs[min(max(inside) + 1, len(xs) - 1)]  # one point past the top: the line leaves the chart visibly
    span = [math.log10(xs[0]) - 0.05, math.log10(last) + 0.05] if xs and xs[0] > 0 else None
    layout = dict(title=dict(text=title), height=520, margin=dict(l=10, r=10, t=40, b=10), shapes=shapes,
                  annotations=annotations, xaxis=dict(title=dict(text=xlabel), type="log", range=span,
                                                       tickvals=xs, ticktext=[f"{x:,}" for x in xs]),
                  yaxis=dict(title=dict(text="GiB per GPU"), range=[0, top]), legend=dict(orientation="h", y=-0.25))
    return dict(data=data, layout=layout)


def timeline_figure(sim, est) -> dict:
    """Live bytes over the ops of the simulated step, phase boundaries, the peak, and the closed-form estimate."""
    points = sim.timeline_points()
    data = [dict(type="scatter", mode="lines", x=[p[0] for p in points], y=[gib(p[1]) for p in points],
                 name="simulated live memory", line=dict(color=CATEGORY_COLORS[0]),
                 hovertemplate="op %{x}: %{y:.3f} GiB<extra></extra>"),
            dict(type="scatter", mode="markers", x=[sim.peak_op_index], y=[gib(sim.peak_bytes)], name="peak",
                 marker=dict(color="red", size=10),
                 hovertemplate=f"peak {format_gib(sim.peak_bytes)} in {sim.peak_phase} "
                               f"(iteration {sim.peak_iteration})<extra></extra>")]
    shape, label = hline(gib(est.peak_bytes), f"closed-form estimate {format_gib(est.peak_bytes)}", "green", "dot")
    shapes, annotations = [shape], [label]
    for ph in sim.phases:
        if ph.iteration < 1 or ph.name == "reset":
            continue
        shapes.append(dict(type="line", yref="paper", y0=0, y1=1, x0=ph.first_op, x1=ph.first_op,
                           line=dict(color="#BAB0AC", dash="dot", width=1)))
        annotations.append(dict(yref="paper", y=1, x=ph.first_op, text=f"{ph.name} {ph.iteration}",
                                showarrow=False, xanchor="left", yanchor="top", textangle=-90,
                                font=dict(color="#6f6f6f", size=10)))
    layout = dict(title=dict(text=f"Simulated step: peak {format_gib(sim.peak_bytes)} in {sim.peak_phase} of "
                                  f"iteration {sim.peak_iteration}"), height=460,
                  margin=dict(l=10, r=10, t=40, b=10), shapes=shapes, annotations=annotations,
                  xaxis=dict(title=dict(text="op index (allocations and frees in program order)")),
                  yaxis=dict(title=dict(text="GiB allocated (this rank)")), legend=dict(orientation="h", y=-0.2))
    return dict(data=data, layout=layout)
