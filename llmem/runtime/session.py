"""Prepare a plan's training (model, wrapping, optimizer, inputs) and run one iteration (DESIGN.md §1)."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from llmem.errors import InputError
from llmem.plan import Engine, Loss, Method, Scheme, TrainingPlan
from llmem.runtime import chunked
from llmem.runtime.lora import apply_method
from llmem.runtime.model import build_model
from llmem.runtime.optim import InBackward, make_optimizer
from llmem.runtime.parallel import check_supported, uses_fsdp, wrap
from llmem.runtime.selective import enable_selective
from llmem.runtime.topology import Topology

SEED = 1234

Mark = Callable[[str], None]


def _no_mark(_name: str) -> None:
    pass


@dataclass
class Session:
    """Everything one rank needs to run iterations of a plan."""

    plan: TrainingPlan
    model: nn.Module
    optimizer: torch.optim.Optimizer | InBackward  # --optimizer-in-backward: stepped by hooks in backward
    input_ids: torch.Tensor
    device_type: str
    schedule: object = None  # --pp: this rank's pipeline schedule (`runtime.pipeline`); `model` is its stage
    rank: int = 0
    offload_ctx: object = None  # --activation-offload: torchtune's OffloadActivations (`runtime.act_offload`)
    cp_mesh: object = None  # --cp: the context-parallel mesh dim (`runtime.context_parallel`)

    def autocast(self):
        """Autocast for mixed precision, except under FSDP2 where the MixedPrecisionPolicy casts instead, and under
        DeepSpeed, whose engine casts the module to bf16 (`engine.py`: `_configure_distributed_model`)."""
        if not self.plan.precision.is_mixed or uses_fsdp(self.plan) or self.plan.engine is Engine.DEEPSPEED:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=getattr(torch, self.plan.precision.compute_dtype_name))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def enable_checkpointing(model: nn.Module, plan: TrainingPlan) -> None:
    """`--grad-ckpt full [--ckpt-every K]`: transformers' own per-layer switch. `every_n_layers=K` sets
    `gradient_checkpointing = (index % K == 0)` on the decoder layers (the `GradientCheckpointingLayer`s, counted in
    module order); K = 1 is `gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})`.
    Checked here: exactly the decoder layers with index % K == 0 are checkpointed, as the estimate assumes."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    kwargs = {"every_n_layers": plan.ckpt_every} if plan.ckpt_every > 1 else {}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}, **kwargs)
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    flags = [bool(m.gradient_checkpointing) for m in layers]
    expected = [plan.checkpointed(i) for i in range(len(layers))]
    if len(layers) != int(model.config.num_hidden_layers) or flags != expected:
        raise RuntimeError(f"checkpointing flags {flags} on {len(layers)} layers differ from the plan's {expected}")


def prepare(config: dict, plan: TrainingPlan, topo: Topology | None = None, mark: Mark = _no_mark) -> Session:
    """Build (in the target dtype), wrap and make the optimizer; inputs are random token ids of (batch, seq).

    Every rank builds the same weights (same seed); the inputs differ per data-parallel rank and are equal within
    a tensor-parallel group. MoE routing depends on the data, so the seeds make runs repeatable.
    """
    topo = topo or Topology()
    if topo.world_size != plan.gpus:
        raise InputError("gpus", f"the plan needs {plan.gpus} processes, this launch has {topo.world_size}")
    check_supported(str(config.get("model_type")), plan, config)
    if plan.loss is Loss.CHUNKED_CE:
        chunked.check_model(str(config.get("model_type")), plan.tp)
    seed_everything(SEED)
    mark("build")
    model = build_model(config, plan, topo.device)
    if plan.grad_ckpt.value == "full":
        enable_checkpointing(model, plan)
    elif plan.grad_ckpt.value == "selective":
        enable_selective(model)
    if plan.tp > 1 and plan.method is not Method.FULL:  # TP first, PEFT after (`llmem.runtime.lora_tp`)
        from llmem.runtime.lora_tp import prepare_lora_tp

        if plan.loss is Loss.CHUNKED_CE:
            chunked.chunk_output_head(model, plan.loss_chunks)
        mark("wrap")
        wrapped = model = prepare_lora_tp(model, plan, topo.device_type)
        cp_mesh = None
    else:
        model = apply_method(model, plan)
        if plan.loss is Loss.CHUNKED_CE:  # after PEFT: a trained lm_head copy (modules_to_save) runs the chunks
            chunked.chunk_output_head(model, plan.loss_chunks)
        if plan.float8.value != "none":  # torchao's Float8Linear, before wrapping (`llmem.runtime.float8`)
            from llmem.runtime.float8 import convert

            convert(model, plan)
        mark("wrap")
        if plan.pp > 1:
            return _prepare_pipeline(model, plan, topo)
        cp_mesh = _prepare_context_parallel(model, plan, topo) if plan.cp > 1 else None
        wrapped = wrap(model, plan, topo.device_type)
    trainable = [p for p in wrapped.parameters() if p.requires_grad]
    if plan.optimizer_in_backward:
        optimizer = InBackward(trainable, plan)
    elif plan.engine is Engine.DEEPSPEED:
        from llmem.runtime import deepspeed

        wrapped, optimizer = deepspeed.initialize(wrapped, make_optimizer(trainable, plan), plan)
    else:
        optimizer = make_optimizer(trainable, plan, zero1=plan.scheme is Scheme.ZERO1)
    dp_rank = topo.rank // (plan.tp * plan.cp)  # a TP group, or a context-parallel group, shares its batch
    gen = torch.Generator().manual_seed(SEED + 1 + dp_rank)
    vocab = int(model.config.vocab_size)
    ids = torch.randint(0, vocab, (plan.batch_size, plan.seq_len), generator=gen).to(topo.device)
    seed_everything(SEED + 2 + dp_rank)
    offload_ctx = None
    if plan.activation_offload:
        from llmem.runtime.act_offload import offloading_context

        offload_ctx = offloading_context(model, torch.device(topo.device))
    return Session(plan, wrapped, optimizer, ids, topo.device_type, offload_ctx=offload_ctx, cp_mesh=cp_mesh)


def _prepare_context_parallel(model: nn.Module, plan: TrainingPlan, topo: Topology):
    """`--cp`: the ("dp", "cp") mesh (cp inner, as torchtitan's and accelerate's), the self_attn mask hooks, and on
    CPU the ring's handler for torch's CPU flash kernel (`runtime.context_parallel`). FSDP2 shards over every rank
    (`wrap`): torchtitan's and accelerate's flattened dp_shard × cp mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    from llmem.runtime import context_parallel

    if topo.device_type == "cpu":
        context_parallel.enable_cpu_kernel()
    context_parallel.attach_mask_hooks(model)
    return init_device_mesh(topo.device_type, (plan.gpus // plan.cp, plan.cp), mesh_dim_names=("dp", "cp"))["cp"]


def _prepare_pipeline(model: nn.Module, plan: TrainingPlan, topo: Topology) -> Session:
    """`--pp`: this rank's stage of `model` (the rest freed), its schedule and optimizer; every rank of a pipeline
    draws the same step batch (stage 0 reads it as inputs, the last stage as labels), each data-parallel replica
    its own (`--gpus` = pp × dp: each stage wrapped for data parallelism, `pipeline.wrap_data_parallel`)."""
    from llmem.runtime import pipeline

    pp_rank, dp_rank = divmod(topo.rank, plan.dp)  # `pipeline.process_groups`: pp outer, dp inner
    pp_group, dp_mesh = pipeline.process_groups(plan, topo.device_type)
    stage = pipeline.split(model, plan, pp_rank, topo.device)
    vocab = int(model.config.vocab_size)
    del model
    stage = pipeline.wrap_data_parallel(stage, plan, dp_mesh)
    schedule = pipeline.make_schedule(stage, plan, pp_rank, topo.device, group=pp_group)
    optimizer = make_optimizer([p for p in stage.parameters() if p.requires_grad], plan)
    gen = torch.Generator().manual_seed(SEED + 1 + dp_rank)
    ids = torch.randint(0, vocab, (plan.batch_size, plan.seq_len), generator=gen).to(topo.device)
    seed_everything(SEED + 2 + dp_rank)
    return Session(plan, stage, optimizer, ids, topo.device_type, schedule=schedule, rank=pp_rank)


def _forward_loss(session: Session):
    """The forward and the loss: the model output with transformers' ForCausalLMLoss on its logits (the output,
    logits and all, kept by the caller), or with `--loss chunked-ce` the loss of torchtune's chunked program alone
    (its logits dropped before backward, `llmem.runtime.chunked`)."""
    if session.offload_ctx is not None:  # torchtune: `with activations_handling_ctx: logits = model(...)`, then loss
        return _offloaded_forward_loss(session)
    if session.plan.loss is Loss.CHUNKED_CE:
        return chunked.loss_step(session.model, session.input_ids, session.plan.loss_chunks)
    return session.model(input_ids=session.input_ids, labels=session.input_ids)


def _offloaded_forward_loss(session: Session):
    """`--activation-offload`: the forward under torchtune's OffloadActivations and the loss after it
    (`recipes/full_finetune_single_device.py:636-650`), the same ops as `_forward_loss` otherwise: transformers'
    `loss_function` (ForCausalLMLoss, which its forward calls on the logits), or torchtune's chunked loss."""
    ids = session.input_ids
    with session.offload_ctx:
        out = session.model(input_ids=ids)
    if session.plan.loss is Loss.CHUNKED_CE:
        logits = out.logits
        del out
        loss = chunked.chunked_loss(logits, ids, session.plan.loss_chunks)
        del logits
        return loss
    out.loss = session.model.loss_function(logits=out.logits, labels=ids, vocab_size=session.model.config.vocab_size)
    return out


def train_step(session: Session, mark: Mark = _no_mark) -> None:
    """One iteration exactly as DESIGN.md §1: forward with labels (HF loss; `--loss chunked-ce`: torchtune's chunked
    loss), backward, step, zero_grad.
    With `--grad-accum K`: K micro-steps (forward + backward, outputs dropped in between; the gradients accumulate
    in `.grad`), then one step and zero_grad. Every micro-step uses the same micro-batch; the last micro-step's
    outputs live until after zero_grad, as with K = 1. `--optimizer-in-backward`: each parameter is stepped and its
    gradient freed inside backward (`optim.InBackward`), no step or zero_grad after it."""
    if session.schedule is not None:  # --pp: the schedule runs every microbatch's forward and backward
        from llmem.runtime.pipeline import pipeline_step

        mark("pipeline")  # autocast: inside each stage forward and loss (`runtime.pipeline.Stage`)
        pipeline_step(session.schedule, session.rank, session.plan.pp, session.input_ids)
        mark("optimizer")
        session.optimizer.step()
        mark("zero_grad")
        session.optimizer.zero_grad(set_to_none=True)
        mark("end")
        return
    out = None
    for micro in range(session.plan.grad_accum):
        suffix = f" (micro-step {micro + 1})" if micro else ""
        del out  # the previous micro-step's outputs (logits, loss) are dropped before the next forward
        mark("forward" + suffix)
        cp_ctx = contextlib.nullcontext()
        if session.cp_mesh is not None:  # this step's shards of the batch, the ring around forward and backward
            from llmem.runtime.context_parallel import shard_inputs

            cp_ctx, cp_inputs = shard_inputs(session.cp_mesh, session.input_ids)
        with cp_ctx, _sync_context(session, micro):
            with session.autocast():
                out = session.model(**cp_inputs) if session.cp_mesh is not None else _forward_loss(session)
            mark("backward" + suffix)
            loss = out if isinstance(out, torch.Tensor) else out.loss
            _backward(session, loss, micro)
            del loss
    _step(session, mark)
    del out
    mark("end")


@contextlib.contextmanager
def _sync_context(session: Session, micro: int):
    """`--no-sync`: micro-steps 1..K-1 of `--grad-accum K` (forward and backward) without synchronizing, the last
    synced, as accelerate 1.15 `Accelerator.accumulate`/`no_sync` (accelerator.py:1255-1298, 1132-1178) and the HF
    Trainer (transformers 5.23 trainer.py:1896-1907) run them: DDP's and FSDP1's `no_sync()`, FSDP2's
    `set_requires_gradient_sync(False)` on the root (recursing into every group), restored after."""
    plan = session.plan
    if not plan.no_sync or micro == plan.grad_accum - 1:
        yield
    elif uses_fsdp(plan) and plan.engine is Engine.TORCH:
        session.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            session.model.set_requires_gradient_sync(True)
    else:
        with session.model.no_sync():
            yield


def _backward(session: Session, loss, micro: int) -> None:
    if session.plan.engine is Engine.DEEPSPEED:  # accelerate's DeepSpeedEngineWrapper.backward (accelerate 1.15
        # utils/deepspeed.py:267: the boundary set before each backward, the last micro-step's True)
        session.model.set_gradient_accumulation_boundary(micro == session.plan.grad_accum - 1)
        session.model.backward(loss)
    else:
        loss.backward()


def _step(session: Session, mark: Mark = _no_mark) -> None:
    if session.plan.engine is Engine.DEEPSPEED:
        mark("optimizer")
        session.model.step()  # the step, zero_grad and the all-gather of the new partitions
    elif not session.plan.optimizer_in_backward:  # else each parameter was stepped and zeroed in its hook
        mark("optimizer")
        session.optimizer.step()
        mark("zero_grad")
        session.optimizer.zero_grad(set_to_none=not session.plan.keep_grads)  # --keep-grads
