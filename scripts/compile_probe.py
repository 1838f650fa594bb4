"""torch.compile probe (docs/notes/2026-11-27-torch-compile.md): what compiling each decoder layer does to memory.

    PYTHONPATH=. python scripts/compile_probe.py saved  --precision fp32 --batch 8 --seq 256   # fake tensors
    PYTHONPATH=. python scripts/compile_probe.py peak   --mode compile --precision fp32 --batch 8 --seq 256
    PYTHONPATH=. python scripts/compile_probe.py window --mode compile --precision fp32 --batch 8 --seq 256

Each decoder layer of one of the sweep's small configs (`--model`, default llama-gqa) is compiled as torchtitan and
torchtune apply it (per transformer block, `fullgraph=True`, in place: `nn.Module.compile`).
`saved`: the model on fake CPU tensors (`llmem.derive.trace.build`), each layer compiled by inductor's own
`compile_fx` with an `inner_compile` that generates no code (the FX graphs run as they are): the joint-graph passes
and the min-cut partition are inductor's; the backward graph's inputs other than the tangents are what the forward
saves (`--mode eager`: the derive tracer's saved storages per layer instead). `peak`: the real step on CPU
(inductor's C++ backend), `llmem.measure.run.measure_rank`'s peak, beside the eager estimate. `window`: the live
bytes of each layer's forward and backward (profiler tracker, iteration 2), relative to the window's start.
"""

from __future__ import annotations

import argparse
import json
from unittest import mock

import torch

from llmem.plan import TrainingPlan
from llmem.sweep.models import models

CONFIG: dict = {}


def saved(args) -> dict:
    import transformers.masking_utils as masking
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.compile_fx import compile_fx

    from llmem.derive.trace import build

    graphs = []

    def inner(gm, example_inputs, **kwargs):  # inductor's pipeline up to code generation, no code generated
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    mixed = args.precision.endswith("-mixed")
    built = build(CONFIG, "float32" if mixed or args.precision == "fp32" else "bfloat16", "sdpa")
    if args.mode == "eager":  # the derive tracer's saved storages per layer (autocast's weight copies left out)
        from llmem.derive.trace import trace

        traced = trace(built, args.batch, args.seq, "bfloat16" if mixed else None)
        return {"layer_saved_bytes": [sum(b for _, b in layer) for layer in traced.layers]}
    mode, model, layers, _ = built
    def backend(gm, example_inputs):  # one backend for every layer, as `torch.compile`'s default: compiled once
        return compile_fx(gm, example_inputs, inner_compile=inner)

    for layer in layers:
        layer.compile(fullgraph=True, backend=backend)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed)
    with mode, mock.patch.object(masking, "find_packed_sequence_indices", lambda position_ids: None):
        ids = torch.zeros((args.batch, args.seq), dtype=torch.long)
        with autocast:
            logits = model(input_ids=ids).logits
        logits.backward(torch.ones_like(logits))
    backward = next(g for g in graphs if any(n.name.startswith("tangents") for n in g.graph.nodes))
    values = {n.name: n.meta["val"] for n in backward.graph.nodes
              if n.op == "placeholder" and not n.name.startswith("tangents")}
    size, seen = {}, set()  # bytes per storage: a saved view keeps its base's storage, counted once
    for k, v in values.items():
        if isinstance(v, torch.Tensor) and v.untyped_storage()._cdata not in seen:
            seen.add(v.untyped_storage()._cdata)
            size[k] = v.untyped_storage().nbytes()
    weights = {k for k, v in values.items() if k.startswith("permute") and v.dim() == 2 and v.dtype == torch.bfloat16}
    listed = {k: [list(values[k].shape), str(values[k].dtype), b] for k, b in size.items()}
    return {"graphs": len(graphs), "saved": listed,
            "activations_bytes": sum(b for k, b in size.items() if not k.startswith("primals") and k not in weights),
            "layer_input_bytes": sum(b for k, b in size.items() if k.startswith("primals")
                                     and tuple(values[k].shape[:2]) == (args.batch, args.seq)),
            "weight_copies_bytes": sum(size[k] for k in weights)}


def _plan(args) -> TrainingPlan:
    return TrainingPlan(device="cpu", batch_size=args.batch, seq_len=args.seq, precision=args.precision,
                        grad_ckpt=args.grad_ckpt)


def peak(args) -> dict:
    from llmem.estimate import estimate
    from llmem.measure.run import measure_rank
    from llmem.runtime.model import decoder_layers
    from llmem.spec import ModelSpec

    def hook(session, mark):
        if args.mode == "compile":
            for layer in decoder_layers(session.model):
                layer.compile(fullgraph=True)

    plan = _plan(args)
    measured = measure_rank(CONFIG, plan, mark_hook=hook)
    est = estimate(ModelSpec.from_config(CONFIG), plan)
    return {"measured": measured["peak_bytes"], "tracker": measured["tracker"], "estimate_eager": est.peak_bytes,
            "estimate_phase": est.peak_phase}


class _Marked(torch.nn.Module):
    """A decoder layer with phase marks around it (outside the compiled region: hooks on its tensors)."""

    def __init__(self, inner, i: int, mark):
        super().__init__()
        self.inner, self.i, self.mark = inner, i, mark

    def forward(self, hidden_states, *args, **kwargs):
        i, mark = self.i, self.mark
        if hidden_states.requires_grad:
            hidden_states.register_hook(lambda g: mark(f"bw_end_{i}"))
        mark(f"fw_start_{i}")
        out = self.inner(hidden_states, *args, **kwargs)
        mark(f"fw_end_{i}")
        (out[0] if isinstance(out, tuple) else out).register_hook(lambda g: mark(f"bw_start_{i}"))
        return out


def window(args) -> dict:
    from llmem.measure.cpu import CpuTracker
    from llmem.runtime import prepare, train_step
    from llmem.runtime.model import decoder_layers

    torch.set_num_threads(1)
    with CpuTracker() as tr:
        session = prepare(CONFIG, _plan(args), mark=tr.mark)
        layers = decoder_layers(session.model)
        for i in range(len(layers)):
            if args.mode == "compile":
                layers[i].compile(fullgraph=True)
            layers[i] = _Marked(layers[i], i, tr.mark)
        train_step(session)  # iteration 1 compiles
        tr.reset_peak()
        train_step(session)
    t = tr.trace
    start = max(tt for tt, n in t.marks if n.endswith("reset_peak"))
    marks = {n.split("::")[1]: tt for tt, n in t.marks if tt >= start}

    def index(tt):
        return next((k for k, ev in enumerate(t.events) if ev.t >= tt), len(t.events))

    def live(a, z):  # [largest live total in the window, live total at its end], relative to its start
        i, j = index(marks[a]), index(marks[z])
        return [max([t.live_at(i), *t.series[i:j]]) - t.live_at(i), t.live_at(j) - t.live_at(i)]

    out = {"peak": t.peak_bytes}
    for i in range(len(layers)):
        out[f"forward_{i}"] = live(f"fw_start_{i}", f"fw_end_{i}")
        out[f"backward_{i}"] = live(f"bw_start_{i}", f"bw_end_{i}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["saved", "peak", "window"])
    p.add_argument("--model", default="llama-gqa", choices=list(models("small")))
    p.add_argument("--mode", choices=["eager", "compile"], default="compile")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--grad-ckpt", default="none")
    p.add_argument("--intermediate", type=int, default=None, help="intermediate_size (llama-like configs)")
    p.add_argument("--vocab", type=int, default=None)
    args = p.parse_args()
    CONFIG.update(models("small")[args.model])
    CONFIG.update({k: v for k, v in (("intermediate_size", args.intermediate), ("vocab_size", args.vocab))
                   if v is not None})
    print(json.dumps({"what": args.what, "model": args.model, "mode": args.mode, "precision": args.precision,
                      "batch": args.batch, "seq": args.seq, "grad_ckpt": args.grad_ckpt,
                      "intermediate": args.intermediate, "vocab": args.vocab, **globals()[args.what](args)}))


if __name__ == "__main__":
    main()
