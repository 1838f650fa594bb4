"""figures: the plain-dict Plotly specs carry the library's numbers unchanged (GiB on the axes only)."""

import math

from llmem import figures
from llmem.estimate import estimate
from llmem.gpus import get_gpu
from llmem.plan import TrainingPlan
from llmem.presets import load_preset
from llmem.spec import ModelSpec
from llmem.units import gib

SPEC = ModelSpec.from_config(load_preset("llama-3.1-8b"))


def test_breakdown_bars_stack_to_the_peak_and_the_capacity_line_sits_at_the_gpu_memory():
    est = estimate(SPEC, TrainingPlan(gpus=8, zero=3, seq_len=4096))
    gpu = get_gpu("a100-80gb")
    fig = figures.breakdown_figure(est, gpu)
    inside = [b for b in fig["data"] if b["x"] != [figures.OUTSIDE]]
    outside = [b for b in fig["data"] if b["x"] == [figures.OUTSIDE]]
    assert math.isclose(sum(b["y"][0] for b in inside), gib(est.peak_bytes), rel_tol=1e-12)
    assert math.isclose(sum(b["y"][0] for b in outside), gib(est.device_total_bytes - est.peak_bytes), rel_tol=1e-9)
    assert fig["layout"]["shapes"][0]["y0"] == gib(gpu.memory_bytes)
    assert est.peak_phase in fig["layout"]["title"]["text"]


def test_curve_marks_the_largest_fitting_value_and_plots_each_estimate():
    ests = [estimate(SPEC, TrainingPlan(batch_size=b, seq_len=1024)) for b in (1, 2, 4)]
    fig = figures.curve_figure([1, 2, 4], ests, 80 << 30, "t", "micro-batch", 2)
    assert fig["data"][0]["y"] == [gib(e.peak_bytes) for e in ests]
    assert any(s.get("x0") == 2 for s in fig["layout"]["shapes"])
    assert figures.curve_figure([1, 2, 4], ests, 80 << 30, "t", "x", None)["layout"]["shapes"] == \
        fig["layout"]["shapes"][:1]


def test_curve_y_axis_shows_the_capacity_the_crossing_and_the_current_point_and_marks_it():
    ests = [estimate(SPEC, TrainingPlan(batch_size=b, seq_len=1024)) for b in (1, 2, 4)]
    capacity = 24 << 30  # far below every point: the empty chart had only the capacity line in view
    fig = figures.curve_figure([1, 2, 4], ests, capacity, "t", "micro-batch", None, current=2)
    top = fig["layout"]["yaxis"]["range"][1]
    totals = [gib(e.device_total_bytes) for e in ests]
    assert top >= totals[0] and top >= totals[1] and top >= gib(capacity)  # the first point and the current one
    roomy = figures.curve_figure([1, 2, 4], ests, 1 << 40, "t", "x", 4, current=1)["layout"]["yaxis"]["range"][1]
    assert gib(1 << 40) <= roomy < 1.2 * gib(1 << 40)  # all fit: the capacity sets the scale
    current = [d for d in fig["data"] if d["name"].startswith("current")]
    assert current and current[0]["x"] == [2] and current[0]["y"] == [gib(ests[1].device_total_bytes)]


def test_breakdown_labels_each_bar_leaves_out_empty_categories_and_shows_the_capacity():
    est = estimate(SPEC, TrainingPlan(method="lora", precision="bf16"))
    gpu = get_gpu("a100-80gb")
    fig = figures.breakdown_figure(est, gpu)
    assert all(b["y"][0] > 0 and b["text"] == [f"{b['y'][0]:.2f}"] for b in fig["data"])
    assert len(fig["data"]) == sum(1 for n in est.breakdown.values() if n > 0) + sum(
        1 for n in (est.fragmentation_bytes, est.cuda_context_bytes, est.paged_state_bytes) if n > 0)
    assert fig["layout"]["yaxis"]["range"][1] >= gib(gpu.memory_bytes)
    assert fig["layout"]["annotations"][0]["xanchor"] == "right"


def test_curve_x_axis_ends_one_point_past_the_top_instead_of_half_empty():
    xs = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    ests = [estimate(SPEC, TrainingPlan(batch_size=b, seq_len=2048, gpus=8, zero=3)) for b in xs]
    fig = figures.curve_figure(xs, ests, 80 << 30, "t", "micro-batch", None, current=1)
    top = fig["layout"]["yaxis"]["range"][1]
    inside = [x for x, e in zip(xs, ests, strict=True) if gib(e.device_total_bytes) <= top]
    low, high = fig["layout"]["xaxis"]["range"]
    assert low < math.log10(1) and math.log10(max(inside)) < high <= math.log10(xs[xs.index(max(inside)) + 1]) + 0.05


def test_the_breakdown_and_curve_specs_pass_plotlys_validation():
    """The app hands these to streamlit unvalidated (`llmem.ui.results.Checked`): plotly's schema checks them here."""
    import plotly.graph_objects as go

    plans = (TrainingPlan(method="lora", precision="bf16"), TrainingPlan(gpus=8, zero=3, offload="optimizer+params"))
    for plan in plans:
        est = estimate(SPEC, plan)
        go.Figure(**figures.breakdown_figure(est, get_gpu("a100-80gb")))
        ests = [estimate(SPEC, plan.with_(batch_size=b)) for b in (1, 2, 4, 8)]
        for largest, current in ((2, 1), (None, 8)):
            go.Figure(**figures.curve_figure([1, 2, 4, 8], ests, 80 << 30, "t", "micro-batch", largest, current))
