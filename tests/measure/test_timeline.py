"""timeline: its phase marks change nothing the step allocates."""

from llmem.measure.run import measure_rank
from llmem.measure.timeline import phase_of, timeline
from llmem.plan import TrainingPlan

# the suite's gpt_neox with a 64-token vocabulary: at 1 x 256 the last layer's eager attention core (softmax
# backward) is the step's peak, after the residual stream's gradient was summed (parallel residual)
NEOX = {"model_type": "gpt_neox", "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "vocab_size": 64, "max_position_embeddings": 256, "rotary_pct": 0.25}


def test_timeline_marks_keep_the_measured_peak():
    """The timeline's peak is `measure`'s to the byte, and falls in the last layer's backward. Its backward marks
    once were full backward pre-hooks, whose `BackwardHook` keeps a layer's output gradient until the layer's input
    gradient exists: autograd then could not sum the residual gradient in place, and the timeline read one
    tokens x hidden fp32 buffer (65,536 B, 0.9 %) above the real step here."""
    plan = TrainingPlan(device="cpu", method="full", precision="bf16-mixed", attn="eager", batch_size=1,
                        seq_len=256)
    trace = timeline(dict(NEOX), plan, steps=1)
    measured = measure_rank(dict(NEOX), plan, 1)["peak_bytes"]
    assert trace.peak_bytes == measured
    assert phase_of(trace, trace.events[trace.peak_index].t) == "backward layer 1"
