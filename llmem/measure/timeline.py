"""Timeline of live bytes per phase of a real CPU run, and the largest live allocations at the peak.

    python -m llmem.measure.timeline CONFIG.json [--steps 2] [--top 15] [plan options: --batch-size 2 ...]

Phases: build, wrap, then per iteration forward (layer i), lm_head+loss, backward (layer i, lm_head),
optimizer, zero_grad. For each phase: live bytes when it starts, the highest live total inside it, and the
live bytes when it ends. A calibration aid for the estimator: it is the same run `measure` does (one rank).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

import torch

from llmem.errors import InputError
from llmem.measure.cpu import RESET, CpuTrace, CpuTracker
from llmem.plan import TrainingPlan
from llmem.runtime import decoder_layers


@dataclass
class Phase:
    name: str
    start: int
    peak: int
    end: int


def mark_backward(module, mark, name: str) -> None:
    """Mark `name` when the gradient of `module`'s output exists: a hook on the output tensor, as `llmem.derive.trace`
    does. Not `register_full_backward_pre_hook`: its `BackwardHook` keeps the output gradient in `self.grad_outputs`
    until the module's input gradient exists (torch 2.13 `torch/utils/hooks.py` `setup_output_hook`, cleared in
    `_set_user_hook`), a reference the real step does not hold. That kept a decoder layer's output gradient alive
    through its backward and stopped autograd from summing the residual stream's gradient into it in place
    (`torch/csrc/autograd/input_buffer.cpp`, only when it holds the last reference): an out-of-place `aten::add`, one
    more tokens × hidden buffer at the attention core's softmax backward (starcoder2 full bf16-mixed eager, vocab 64,
    1 × 256: the timeline read 65,536 B above `measure`, 6,638,308 vs 6,572,772)."""
    from torch.utils._pytree import tree_leaves

    def hook(mod, args, output):
        out = next((t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if out is not None and out.grad_fn is not None:  # (a checkpoint's recompute: its output gets no gradient)
            out.register_hook(lambda g: mark(name))

    module.register_forward_hook(hook)


def install_layer_marks(session, mark) -> None:
    """Forward / backward marks on each decoder layer and on the output head (where the loss follows)."""
    model = session.model
    inner = getattr(model, "module", model)
    for i, layer in enumerate(decoder_layers(inner)):
        layer.register_forward_pre_hook(lambda *_, i=i: mark(f"forward layer {i}"))
        mark_backward(layer, mark, f"backward layer {i}")
    head = inner.get_output_embeddings()
    if head is not None:
        head.register_forward_pre_hook(lambda *_: mark("lm_head + loss"))
        mark_backward(head, mark, "backward lm_head")


def phases(trace: CpuTrace) -> list[Phase]:
    """Split the event series at the marks."""
    out: list[Phase] = []
    bounds = [(t, name.removeprefix("llmem::")) for t, name in trace.marks]
    idx = 0
    n = len(trace.events)
    for k, (t, name) in enumerate(bounds):
        t_next = bounds[k + 1][0] if k + 1 < len(bounds) else None
        while idx < n and trace.events[idx].t < t:
            idx += 1
        start = trace.live_at(idx)
        j = idx
        while j < n and (t_next is None or trace.events[j].t < t_next):
            j += 1
        peak = max([start, *trace.series[idx:j]])
        out.append(Phase(name, start, peak, trace.live_at(j)))
        idx = j
    return out


def phase_of(trace: CpuTrace, t: int) -> str:
    name = "start"
    for tm, mark in trace.marks:
        if tm > t:
            break
        name = mark.removeprefix("llmem::")
    return name


def fmt(n: int) -> str:
    return f"{n / 2**20:10.3f} MiB"


def render(trace: CpuTrace, top: int = 15) -> str:
    lines = [f"{'phase':<28}{'start':>15}{'peak':>15}{'end':>15}"]
    for ph in phases(trace):
        if ph.name == RESET.removeprefix("llmem::"):
            lines.append("-- peak statistic reset --")
            continue
        lines.append(f"{ph.name:<28}{fmt(ph.start)}{fmt(ph.peak)}{fmt(ph.end)}")
    i = trace.peak_index
    peak_t = trace.events[i].t if 0 <= i < len(trace.events) else 0
    lines.append("")
    lines.append(f"peak {trace.peak_bytes:,} bytes ({fmt(trace.peak_bytes).strip()}) in phase "
                 f"'{phase_of(trace, peak_t)}', at the reset {trace.live_at_reset:,} bytes")
    live = sorted(trace.live_allocations(i).values(), key=lambda a: -a.size)
    lines.append(f"largest of the {len(live)} live allocations at the peak:")
    lines.append(f"{'bytes':>14}  {'allocated by':<32}phase")
    for a in live[:top]:
        lines.append(f"{a.size:>14,}  {a.op or '-':<32}{phase_of(trace, a.t)}")
    return "\n".join(lines)


def timeline(config: dict, plan: TrainingPlan, steps: int = 2) -> CpuTrace:
    from llmem.measure.run import measure_rank

    if plan.gpus != 1:
        raise InputError("gpus", "the timeline runs one rank; use --gpus 1")
    tracker = CpuTracker()
    measure_rank(config, plan, steps, tracker=tracker, mark_hook=install_layer_marks)
    return tracker.trace


def _plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Every plan option of the options table (`llmem.options`), as the estimate command takes them."""
    from llmem.options import ARGUMENT, PLAN_OPTIONS

    for option in PLAN_OPTIONS:
        if option.cli == ARGUMENT:
            parser.add_argument(f"--{option.key}", **option.cli_argument())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmem.measure.timeline", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="path to a config.json")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--top", type=int, default=15)
    _plan_arguments(parser)
    args = parser.parse_args(argv)
    try:
        with open(args.config) as fh:
            config = json.load(fh)
        from llmem.options import PLAN_OPTIONS

        plan = TrainingPlan(**{o.name: getattr(args, o.name) for o in PLAN_OPTIONS if hasattr(args, o.name)}
                            | {"device": "cpu"})
        trace = timeline(config, plan, args.steps)
    except (InputError, OSError, json.JSONDecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(render(trace, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
