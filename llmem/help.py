"""Help text for each knob — what it does to memory. Written once (an option's in its row of `llmem.options`), shown
by the CLI and the app."""

from llmem.options import OPTIONS

HELP = {o.key: o.help for o in OPTIONS} | {
    "plan-ckpt": "Pick the checkpointing (none, every K-th layer, full) that recomputes the fewest layers and still "
                 "fits the GPU; the recompute cost is shown as approximate extra forward FLOPs.",
}

# What the estimate leaves out by design, shown under the plan commands' help (docs/notes/2026-11-27-torch-compile.md).
EAGER_ONLY = ("The estimate is of PyTorch's eager program: torch.compile is not modelled, since it changes what "
              "autograd saves (the min-cut partitioner's choice) and adds fused-kernel buffers that are decided by "
              "the GPU backend's code generation and cannot be derived without the GPU "
              "(the torch.compile note in docs/notes/).")
