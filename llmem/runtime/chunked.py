"""`--loss chunked-ce`: torchtune 0.6.1's chunked-output cross-entropy, run eagerly on a transformers model.

torchtune's program (`torchtune/modules/transformer.py` `TransformerDecoder.chunked_output`,
`torchtune/modules/loss/ce_chunked_output_loss.py` `CEWithChunkedOutputLoss.forward` / `compute_cross_entropy`,
`recipes/full_finetune_single_device.py` `_loss_step`):
  logits = [output(chunk) for chunk in h.chunk(num_output_chunks, dim=1)]      (inside the model's forward)
  labels = torch.hstack((labels[..., 1:], ignore_labels_cache[:batch]))
  total = (labels != -100).sum(); labels = [c.reshape(-1) for c in labels.chunk(num_output_chunks, dim=1)]
  logits = [c.reshape(-1, c.size(-1)) for c in logits]
  loss = sum(F.cross_entropy(c.float(), l, ignore_index=-100, reduction="sum")) / total
  del logits; loss.backward()

Here the lm_head's own forward is replaced on the instance (`chunk_output_head`), so its parameters keep their names
and ties, FSDP2's hooks on the root still run around it, and autocast casts each chunk as torchtune's bf16 model
would compute it. The model is called without labels (transformers' own loss does not run).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from llmem.errors import GAP, InputError

IGNORE_INDEX = -100  # CEWithChunkedOutputLoss(ignore_index=-100)


@functools.cache
def logit_edit(model_type: str) -> str | None:
    """What the family's causal-LM forward does to the logits after `self.lm_head(...)` and before its loss (opt's
    `.contiguous()`, gemma2's softcap, cohere's logit_scale, granite's logits_scaling), read from its source; None
    when the lm_head's output is the logits as they are, as in torchtune's decoders."""
    import inspect

    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    source = inspect.getsource(getattr(transformers, name).forward) if name else ""
    start = source.find("self.lm_head(")
    if start < 0:
        return "no self.lm_head(...) call in its forward"
    ends = [i for i in (source.find("loss = None", start), source.find("if labels is not None", start)) if i > 0]
    block = source[source.rfind("\n", 0, start) + 1:min(ends, default=len(source))].strip().splitlines()
    if len(block) == 1 and block[0].endswith(")") and block[0].count("(") == 1:
        return None
    return "; ".join(line.strip() for line in block)[:160]


def check_model(model_type: str, tp: int = 1) -> None:
    """A family whose causal-LM forward edits the logits after the lm_head (`logit_edit`) is not modelled with the
    chunks: a list of chunks has no such step, and torchtune's decoders have none. Under TP only the hand-written
    Megatron plans run it (their lm_head is replicated); transformers' own plan gathers the lm_head's output in a
    hook that takes one tensor (`colwise_gather_output`)."""
    edit = logit_edit(model_type)
    if edit is not None:
        raise InputError("loss", f"chunked-ce is not modelled for {model_type!r}: its forward changes the logits after "
                         f"the lm_head ({edit}); use --loss standard", GAP)
    from llmem.runtime.parallel import uses_hf_plan

    if tp > 1 and uses_hf_plan(model_type):
        raise InputError("loss", f"chunked-ce under {model_type!r}'s own tensor-parallel plan is not modelled (its "
                         "lm_head's gathered output is one tensor, not a list of chunks); use --tp 1, or --loss "
                         "standard", GAP)


def chunk_output_head(model: nn.Module, chunks: int) -> None:
    """`TransformerDecoder.chunked_output`: the lm_head returns the list of its outputs per chunk of the sequence."""
    head = model.get_output_embeddings()
    original = type(head).forward

    def chunked_output(hidden: torch.Tensor) -> list[torch.Tensor]:
        return [original(head, chunk) for chunk in hidden.chunk(chunks, dim=1)]

    head.forward = chunked_output


def chunked_loss(logits: list[torch.Tensor], input_ids: torch.Tensor, chunks: int) -> torch.Tensor:
    """`_loss_step`'s label shift and `CEWithChunkedOutputLoss.forward` (normalized by the non-ignored tokens)."""
    ignore = torch.full((input_ids.shape[0], 1), IGNORE_INDEX, dtype=input_ids.dtype, device=input_ids.device)
    labels = torch.hstack((input_ids[..., 1:], ignore))
    del ignore
    total_elements = (labels != IGNORE_INDEX).sum()
    labels = [target.reshape(-1) for target in labels.chunk(chunks, dim=1)]
    flat = [chunk.reshape(-1, chunk.size(-1)) for chunk in logits]
    total_loss = 0.0
    for logits_chunk, labels_chunk in zip(flat, labels, strict=True):
        total_loss += F.cross_entropy(logits_chunk.float(), labels_chunk, ignore_index=IGNORE_INDEX, reduction="sum")
    return total_loss / total_elements


def loss_step(model: nn.Module, input_ids: torch.Tensor, chunks: int) -> torch.Tensor:
    """The forward (no labels) and the loss; the logits are dropped before it returns, as `_loss_step` does."""
    logits = model(input_ids=input_ids).logits
    loss = chunked_loss(logits, input_ids, chunks)
    del logits  # "free logits otherwise it peaks backward memory"
    return loss
