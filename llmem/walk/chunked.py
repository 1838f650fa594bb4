"""`--loss chunked-ce` under FSDP2 (ZeRO-2/3): the end of forward, the loss and the lm_head as torchtune's chunked
program runs them (`llmem.components.chunked_ce`). Its loss runs after the model's forward has returned, so after
the root's post-forward: ZeRO-3 has resharded the root, and every scheme has freed the last layer's retained
all-gather output. The root's pre-backward is a hook on the logits chunks, so it runs only when the chunks' loss
backward is done, at the start of the lm_head's (the logits gradients of every chunk alive).
`--activation-offload` runs the standard loss the same way (torchtune's recipes: `logits = self._model(**batch)` under
the manager, the loss after it, `recipes/full_finetune_distributed.py`; `llmem.runtime.session`): one logits tensor,
and at the root's pre-backward the logits and their gradient (`logits.lm_head_backward_bytes`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmem.components import chunked_ce
from llmem.components import communication as comm
from llmem.components import logits as lg
from llmem.walk.phase import Phase, moment

if TYPE_CHECKING:
    from llmem.walk.fsdp import FsdpTerms


def fsdp_head_moments(w: FsdpTerms) -> list[Phase]:
    """The lm_head's chunks in the root's forward (the root and the last layer's all-gather output still alive),
    the loss's forward and backward after the root's post-forward (ZeRO-2: the root and the layers stay gathered;
    ZeRO-3: nothing gathered), the root's pre-backward (ZeRO-3), the lm_head's backward."""
    from llmem.walk.fsdp import root_prebackward_moments

    spec, cp = w.spec, w.cp
    on = dict(**w.persistent, activations=w.forward_acts)
    after_root = 0 if comm.root_resharded_after_forward(w.plan) else w.bwd_head
    chunked = chunked_ce.is_chunked(cp)
    head, head_bwd = (chunked_ce.all_logits_bytes, chunked_ce.head_backward_start_bytes) if chunked else (
        lg.logits_bytes, lg.lm_head_backward_bytes)
    phases = [
        moment("forward (last layer)", **on, communication=w.end_in_layer),
        moment("lm_head forward (chunks)" if chunked else "lm_head forward", **on, logits=head(spec, cp),
               communication=w.end_at_loss),
        moment("loss forward", **on, logits=lg.loss_forward_peak_bytes(spec, cp), communication=after_root),
        moment("loss backward", **on, logits=lg.loss_backward_peak_bytes(spec, cp), communication=after_root),
    ]
    phases += root_prebackward_moments(w, head_bwd(spec, cp))
    return phases + [
        moment("lm_head backward", **on, gradients=w.root_grads_head, logits=lg.lm_head_backward_bytes(spec, cp),
               communication=w.bwd_head),
    ]
