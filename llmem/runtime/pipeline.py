"""`--pp N`: pipeline parallelism as torchtitan runs it (torchtitan/distributed/pipeline_parallel.py at commit
02ef790) with torch.distributed.pipelining (torch 2.13.0), one stage per rank.

- The split: `stage_layers` (torchtitan's `generate_llm_fqn_per_model_part(pp, layers, input_weight=1,
  output_weight=1)`): the embedding and the final norm + lm_head each count as one layer, the `layers + 2` are
  dealt out evenly, the first `(layers + 2) % pp` stages one more. Stage 0 holds the embedding and the first decoder
  layers, the last stage the last layers, the final norm and the lm_head; the rotary embedding (no parameters) runs on
  every stage. `pipeline_module_split` deep-copies the model and drops what the stage does not hold; here each rank
  builds the model and keeps its own modules in a `Stage` (the rest is freed before the peak is reset).
- The stage: `PipelineStage(stage_module, rank, pp, device)` without example inputs: its shapes are inferred in
  the first `step` (a forward and backward of microbatch 0), as torchtitan leaves them.
- The schedule: `ScheduleGPipe` / `Schedule1F1B(stage, n_microbatches=M, loss_fn=loss / M, scale_grads=False)`
  (torchtitan's `build_pipeline_schedule`: `rescale_accumulated_loss(loss_fn, M)`). The loss is transformers'
  `ForCausalLMLoss` on the last stage's logits, as the one-GPU program computes it.
- One iteration: stage 0 `step(ids)`, the last stage `step(target=ids, losses=[])`, the others `step()`, all with
  `return_outputs=False` (torchtitan's train loop); then `optimizer.step()`, `zero_grad(set_to_none=True)`.
  `--batch-size` is the step's batch (torchtitan's `local_batch_size`), split into M microbatches along dim 0.
- Mixed precision (bf16-mixed): each stage forward and each loss runs under `torch.autocast`, the backward outside
  it, as in the one-GPU program (DESIGN.md section 2: the forward and the loss under autocast, `backward()` after
  the region). torchtitan itself turns mixed precision off for PP without FSDP (`maybe_enable_amp`).
- On gloo (CPU measurement) the P2P needs no fence (measure/gloo_fence.py): activations are received into the stage's
  own persistent buffers, and a sent tensor is kept by the schedule itself (its output in `fwd_cache`, an input
  gradient by the send's work until the schedule waits for it, which the estimate counts), so no free waits on
  gloo's thread; the two attempts of every measured row agreed to within 4 bytes.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from llmem.plan import PpSchedule, TrainingPlan


def stage_layers(layers: int, pp: int) -> list[range]:
    """The decoder layers of each stage: torchtitan's `generate_llm_fqn_per_model_part` with input and output
    weights 1 (the embedding counts as one layer of stage 0, norm + lm_head as one of the last stage)."""
    from llmem.components.pipeline import stage_layer_counts

    out, start = [], 0
    for count in stage_layer_counts(layers, pp):
        out.append(range(start, start + count))
        start += count
    return out


class Stage(nn.Module):
    """The modules of one stage and the forward of transformers' llama-like `Model.forward` restricted to them:
    embedding (stage 0), positions and rotary embedding, the stage's decoder layers, final norm and lm_head (last
    stage). sdpa only: `create_causal_mask` is None and the attention runs `is_causal`."""

    def __init__(self, model: nn.Module, layers: range, first: bool, last: bool, autocast=None) -> None:
        super().__init__()
        self.autocast = autocast or contextlib.nullcontext
        if hasattr(model, "get_base_model"):  # --method lora: the PEFT model's base, its Linears now LoRA layers
            model = model.get_base_model()
        inner = model.model
        self.config = model.config
        self.embed_tokens = inner.embed_tokens if first else None
        self.layers = nn.ModuleList([inner.layers[i] for i in layers])
        self.rotary_emb = inner.rotary_emb
        self.norm = inner.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None, past_key_values=None,
                                  position_ids=position_ids)
        position_embeddings = self.rotary_emb(h, position_ids=position_ids)
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_embeddings=position_embeddings, position_ids=position_ids)
        if self.norm is not None:
            h = self.lm_head(self.norm(h))
        return h


def split(model: nn.Module, plan: TrainingPlan, rank: int, device: str = "cpu") -> nn.Module:
    """This rank's stage of `model` (rank = stage index); `--pp-schedule interleaved-1f1b`: an `nn.ModuleList` of
    its stages `rank, rank + pp, ...` (`components.pipeline.rank_stages`, torchtitan's loop style)."""
    from llmem.components.pipeline import rank_stages

    chunks = [stage_module(model, plan, s, device) for s in rank_stages(plan, rank)]
    return chunks[0] if len(chunks) == 1 else nn.ModuleList(chunks)


def stage_module(model: nn.Module, plan: TrainingPlan, stage: int, device: str = "cpu") -> Stage:
    """Stage `stage` of `model`: its decoder layers (`stage_layers` over every stage), the embedding on the first,
    the final norm and lm_head on the last."""
    from llmem.components.pipeline import num_stages

    total = num_stages(plan)
    layers = stage_layers(int(model.config.num_hidden_layers), total)
    return Stage(model, layers[stage], first=stage == 0, last=stage == total - 1, autocast=autocast_of(plan, device))


def autocast_of(plan: TrainingPlan, device: str):
    """The forward's autocast context (bf16-mixed / fp16-mixed), else a null context."""
    if not plan.precision.is_mixed or plan.zero:  # FSDP2: its MixedPrecisionPolicy casts (`wrap_data_parallel`)
        return contextlib.nullcontext
    half = getattr(torch, plan.precision.compute_dtype_name)
    return functools.partial(torch.autocast, device.split(":")[0], dtype=half)


def make_schedule(module: nn.Module, plan: TrainingPlan, rank: int, device, group=None):
    """`PipelineStage` per stage of `module` (`split`) and the plan's schedule over them, with transformers'
    causal-LM loss divided by M. The looped schedule gets the list of this rank's stages, as torchtitan's
    `build_pipeline_schedule` passes `stages if looped_schedule else stages[0]`. `rank` is the pipeline rank,
    `group` the pipeline's process group (None: the whole world, `--gpus` = `--pp`)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    from llmem.components.pipeline import num_stages, rank_stages

    chunks = list(module) if isinstance(module, nn.ModuleList) else [module]
    stages = [PipelineStage(c, s, num_stages(plan), torch.device(device), group=group)
              for c, s in zip(chunks, rank_stages(plan, rank), strict=True)]
    inner = getattr(chunks[0], "module", chunks[0])  # a DDP-wrapped stage (`wrap_data_parallel`)
    vocab, m, autocast = int(inner.config.vocab_size), plan.microbatches, inner.autocast
    from transformers.loss.loss_utils import ForCausalLMLoss

    def loss_fn(logits, labels):
        with autocast():
            return ForCausalLMLoss(logits, labels, vocab_size=vocab) / m

    if plan.pp_schedule is PpSchedule.INTERLEAVED_1F1B:
        return ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
    cls = ScheduleGPipe if plan.pp_schedule is PpSchedule.GPIPE else Schedule1F1B
    return cls(stages[0], n_microbatches=m, loss_fn=loss_fn, scale_grads=False)


def pipeline_step(schedule, rank: int, pp: int, input_ids: torch.Tensor) -> None:
    """One `step` of the schedule on this rank: stage 0 takes the inputs, the last stage the targets (rank 0 and
    rank pp - 1 under the looped schedule too: stage 0 and stage pp × V - 1 are theirs)."""
    if rank == 0:
        schedule.step(input_ids, return_outputs=False)
    elif rank == pp - 1:
        schedule.step(target=input_ids, losses=[], return_outputs=False)
    else:
        schedule.step(return_outputs=False)


def process_groups(plan: TrainingPlan, device_type: str):
    """(pipeline group, data-parallel mesh) of this rank, or (None, None) with one stage per GPU. torchtitan's
    `ParallelDims` mesh puts "pp" outermost (torchtitan/distributed/parallel_dims.py at 018740b:
    `["pp", "dp_replicate", "fsdp", "cp", "tp"]`): rank = pp_rank × dp + dp_rank, so the dp replicas of a stage are
    neighbours and a pipeline's ranks are dp apart."""
    if plan.dp == 1:
        return None, None
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (plan.pp, plan.dp), mesh_dim_names=("pp", "dp"))
    return mesh["pp"].get_group(), mesh["dp"]


def wrap_data_parallel(module: nn.Module, plan: TrainingPlan, dp_mesh) -> nn.Module:
    """`--gpus` = pp × dp: each stage module wrapped for data parallelism over its dp mesh.

    `--zero 0`: `DistributedDataParallel` (default bucket size, `gradient_as_bucket_view=False`). torch's
    `PipelineStage` runs a DDP stage's forwards and every backward but the last under `no_sync` and calls
    `reducer.prepare_for_backward` before the last (torch/distributed/pipelining/stage.py at 2.13.0,
    `forward_maybe_with_nosync`, `backward_maybe_with_nosync`), so the gradients of the M microbatches accumulate
    in `.grad` and are all-reduced once. (torchtitan itself refuses DDP beside PP: its `parallelize_llama` raises
    "DDP has not supported > 1D parallelism".)

    `--zero 3`: FSDP2 as torchtitan's `apply_fsdp` (torchtitan/models/llama3/infra/parallelize.py at 018740b)
    applies it to a pipeline stage: `fully_shard` on the embedding, each decoder layer and [final norm, lm_head]
    with `reshard_after_forward = not pp_enabled` (False: "do not reshard after forward to avoid per-microbatch
    all-gathers"), then on the stage (the root); `MixedPrecisionPolicy(param_dtype=<half>, reduce_dtype=float32)`
    under mixed precision. `PipelineStage` runs every backward with `set_requires_gradient_sync(False)` and
    `set_reshard_after_backward(False)` and reduce-scatters once in `perform_reduce_grad` after the last
    (stage.py `backward_maybe_with_nosync`, `perform_reduce_grad`)."""
    if dp_mesh is None:
        return module
    chunks = list(module) if isinstance(module, nn.ModuleList) else [module]
    if plan.zero == 0:
        from torch.nn.parallel import DistributedDataParallel

        wrapped = [DistributedDataParallel(c, process_group=dp_mesh.get_group()) for c in chunks]
    else:
        wrapped = [_fully_shard_stage(c, plan, dp_mesh) for c in chunks]
    return wrapped[0] if len(wrapped) == 1 else nn.ModuleList(wrapped)


def _fully_shard_stage(stage: Stage, plan: TrainingPlan, dp_mesh) -> nn.Module:
    """torchtitan's `apply_fsdp` on one stage (`wrap_data_parallel`)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = {"mesh": dp_mesh}
    if plan.precision.is_mixed:
        half = getattr(torch, plan.precision.compute_dtype_name)
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)
    if stage.embed_tokens is not None:
        fully_shard(stage.embed_tokens, reshard_after_forward=False, **kwargs)
    for layer in stage.layers:
        fully_shard(layer, reshard_after_forward=False, **kwargs)
    if stage.norm is not None:
        fully_shard([stage.norm, stage.lm_head], reshard_after_forward=False, **kwargs)
    return fully_shard(stage, **kwargs)
