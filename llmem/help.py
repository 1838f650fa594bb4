"""Help text for each knob — what it does to memory. Written once (an option's in its row of `llmem.options`), shown
by the CLI and the app."""

from llmem.options import OPTIONS

HELP = {o.key: o.help for o in OPTIONS} | {
    "plan-ckpt": "Pick the checkpointing (none, every K-th layer, full) that recomputes the fewest layers and still "
                 "fits the GPU; the recompute cost is shown as approximate extra forward FLOPs.",
}
