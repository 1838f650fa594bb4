"""`--pp N` under fake tensors: one stage, as the rank that holds it, on torch's fake process group
(docs/SIMULATION.md). The schedule, the stage's metadata inference and every send/recv run as in the real program;
`FakeProcessGroup` (torch 2.13, `torch/csrc/distributed/c10d/FakeProcessGroup.hpp`) completes each `send` / `recv`
at once without touching the tensors, and the receive buffers are the stage's own, allocated and counted as on a
real rank. Three exchanges carry *values* that the fake group cannot deliver; they are answered with what the
other ranks of the same program send:

  * the warm-up vote (`_PipelineSchedule._warmup_p2p`, torch 2.13 `distributed/pipelining/schedules.py`: each
    stage's `_warmup_forward_vote` / `_warmup_backward_result` send and receive a 1-element tensor, and the result
    is read with `.item()`): the product of every stage's vote `InferenceMode.needs_dynamic(stage._user_meta, ...)`.
    Every stage of the runtime is built alike (no example inputs, `runtime.pipeline.make_schedule`), so each votes
    as this one does: the `.item()` answers this stage's own vote (0, DYNAMIC: shapes inferred at the first
    `step`, as torchtitan leaves them); the vote's tensors and send/recv run as they are;
  * the forward metadata a stage receives (`_recv_meta` from the previous stage, a pickled `_StageForwardMeta` of
    the previous stage's outputs, `recv_object_list`): computed by running the previous stages' forwards on a
    microbatch of the same shape, untracked (the other ranks' memory), with grad enabled as their metadata
    inference runs (`_forward_metadata_inference`, `has_backward`);
  * the backward metadata (`_recv_meta` from the next stage: the next stage's input gradients, the gradients of
    this stage's outputs): `_derive_grad_metas` of this stage's own output metadata — the shape, stride and dtype
    of each output, as a gradient has them.
  `_send_meta` sends nothing (`send_object_list`'s pickled bytes: a few hundred host bytes before the first
  forward, not counted).
And one lifetime the fake group would shorten: a real work object keeps its send's tensor until the schedule drops
the work; `FakeWork` keeps nothing (`HeldWork` below)."""

from __future__ import annotations

import contextlib

from llmem.plan import TrainingPlan


def _previous_outputs(model, plan: TrainingPlan, stage_index: int, device: str):
    """The metadata stage `stage_index - 1` sends stage `stage_index`: the outputs of stages 0 .. stage_index-1 on
    one microbatch of token ids (`split_args_kwargs_into_chunks`: the step batch split along dim 0 into M
    microbatches); under the looped schedule the stages of every rank, in stage order."""
    import torch
    from torch.distributed.pipelining._utils import _StageForwardMeta, extract_tensor_metas

    from llmem.runtime.pipeline import stage_module

    micro = plan.batch_size // plan.microbatches
    x = torch.zeros(micro, plan.seq_len, dtype=torch.long, device=device)
    with torch.enable_grad():
        for s in range(stage_index):
            x = stage_module(model, plan, s, device)(x)
    return _StageForwardMeta(forward_metas=extract_tensor_metas((x,)))


class HeldWork:
    """A fake group's `Work` with the tensors of its send / recv. A real process group's work keeps them: gloo's
    `SendWork` / `RecvWork` hold the tensor until the work is destroyed, NCCL's `stashed_for_allocator_safety_`
    until the work is waited (`synchronizeStream`); the schedule waits each send work right before it drops it
    (GPipe every forward send's when the step ends, 1F1B its last in `send_work` before firing the next), so both
    hold it as long as the schedule keeps the work, as this does. The estimate counts the same references
    (`components.pipeline.held_output_bytes`, `input_gradient_bytes`). `FakeWork` holds nothing."""

    def __init__(self, work, tensors: list) -> None:
        self.work, self.tensors = work, tensors

    def wait(self, *args, **kwargs):
        return self.work.wait(*args, **kwargs)


def holding_batch_p2p(orig):
    """`schedules._batch_p2p` whose works keep their tensors (`HeldWork`)."""

    def batch_p2p(p2p_ops, desc=None):
        works = orig(p2p_ops, desc)
        if len(works) == len(p2p_ops):
            return [HeldWork(w, [op.tensor]) for w, op in zip(works, p2p_ops, strict=True)]
        return [HeldWork(w, [op.tensor for op in p2p_ops] if i == 0 else []) for i, w in enumerate(works)]

    return batch_p2p


@contextlib.contextmanager
def fake_p2p_values(plan: TrainingPlan, tracker):
    """While simulating a `--pp` plan: the runtime's `pipeline.split` also records the metadata the previous stage
    would send (computed untracked), and the stage's vote and metadata receives answer with it (module docstring)."""
    if plan.pp <= 1:
        yield
        return
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining import stage as stage_mod
    from torch.distributed.pipelining._utils import InferenceMode, _derive_grad_metas, _StageBackwardMeta

    from llmem.runtime import pipeline as runtime_pipeline

    cls, schedule_cls = stage_mod.PipelineStage, schedules._PipelineSchedule
    orig_split, orig_warmup = runtime_pipeline.split, schedule_cls._warmup_p2p
    orig_batch = schedules._batch_p2p
    orig_recv, orig_send = cls._recv_meta, cls._send_meta
    received: dict[int, object] = {}

    def split(model, run_plan, rank, device="cpu"):
        from llmem.components.pipeline import rank_stages

        for stage_index in rank_stages(run_plan, rank):
            if stage_index > 0 and stage_index not in received:
                tracker.paused += 1
                try:
                    received[stage_index] = _previous_outputs(model, run_plan, stage_index, device)
                finally:
                    tracker.paused -= 1
        return orig_split(model, run_plan, rank, device)

    def warmup_p2p(self, stages, has_backward, p2p_done):
        votes = [0 if InferenceMode.needs_dynamic(s._user_meta, has_backward) else 1 for s in stages]
        tracker.scalar_answer = min(votes)  # the product of 0/1 votes; its tensors and send/recv run on the fake group
        try:
            orig_warmup(self, stages, has_backward, p2p_done)
        finally:
            tracker.scalar_answer = None

    def recv_meta(self, src_stage: int):
        if src_stage < self.stage_index:
            return received[self.stage_index]
        return _StageBackwardMeta(backward_metas=_derive_grad_metas(self._stage_meta.outputs))

    def send_meta(self, meta, dst_stage: int) -> None:
        return None

    runtime_pipeline.split, schedules._batch_p2p = split, holding_batch_p2p(orig_batch)
    schedule_cls._warmup_p2p, cls._recv_meta, cls._send_meta = warmup_p2p, recv_meta, send_meta
    try:
        yield
    finally:
        runtime_pipeline.split, schedules._batch_p2p = orig_split, orig_batch
        schedule_cls._warmup_p2p, cls._recv_meta, cls._send_meta = orig_warmup, orig_recv, orig_send
