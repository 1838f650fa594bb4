"""`--cp N`: PyTorch's context-parallel ring attention as torchtitan applies it (torch 2.13
`torch/distributed/tensor/experimental/_context_parallel/_attention.py`, torchtitan's
`create_context_parallel_ctx`): the inputs, labels and position ids of every micro-batch are sharded over the cp
ranks along the sequence (`context_parallel(mesh, buffers=..., buffer_seq_dims=[1, 1, 1])`, the head-tail load
balancer `_create_default_load_balancer` picks for a causal model), and inside the context
`F.scaled_dot_product_attention` runs `_templated_ring_attention` (`_attention.py:317`): every rank keeps its own
queries and passes its keys and values around the ring (the default `_RotateMethod.ALL_GATHER`, `_attention.py:78`).

The CPU kernel. torch's handler (`_sdpa_handler`, `_attention.py:897-933`) dispatches only the CUDA kernels
(`_scaled_dot_product_flash_attention`, `_efficient_attention`, `_cudnn_attention`); on CPU SDPA picks
`_scaled_dot_product_flash_attention_for_cpu`, which has no DTensor sharding rule, so the unpatched program raises
`NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding
strategy registered` (docs/notes/2026-11-27-context-parallel.md). `enable_cpu_kernel` adds, beside torch's
entries, the same two things torch registers for the CUDA flash kernel: a sequence-sharded strategy (as
`_sharding_rules.py:85-168`) and a handler that runs torch's own `_templated_ring_attention` /
`_templated_ring_attention_backward` with the CPU kernel as the per-block `op`. The ring, its buffers, merges and
the autograd graph are torch's; only the per-block kernel is the CPU one, whose outputs are those of the CUDA flash
kernel (`out` in the input dtype, an fp32 logsumexp of (batch, heads, seq)).
"""

from __future__ import annotations

import torch

aten = torch.ops.aten
SEQ_DIM = 2
_CPU_FWD = aten._scaled_dot_product_flash_attention_for_cpu.default
_CPU_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _forward_strategy(op_schema):
    """out, logsumexp, q, k, v all sharded on the sequence (torch's flash CP strategy, `_sharding_rules.py:85`)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    mesh = op_schema.get_mesh_from_args()
    return expand_to_full_mesh_op_strategy(mesh, op_schema, [[Shard(SEQ_DIM)] * 5], input_index=2)


def _backward_strategy(op_schema):
    """grad q/k/v, grad_out, q, k, v, out, logsumexp sharded on the sequence (`_sharding_rules.py:126`)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    mesh = op_schema.get_mesh_from_args(validate=False)
    return expand_to_full_mesh_op_strategy(mesh, op_schema, [[Shard(SEQ_DIM)] * 9], input_index=3)


def _ring_forward(mesh, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention

    if attn_mask is not None:
        raise NotImplementedError("context parallelism runs SDPA without a mask (is_causal)")
    return _templated_ring_attention(mesh.get_group(), SEQ_DIM, _CPU_FWD, query=query, key=key, value=value,
                                     is_causal=is_causal, dropout_p=dropout_p, scale=scale)


def _ring_backward(mesh, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None,
                   scale=None):
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _templated_ring_attention_backward,
    )

    return _templated_ring_attention_backward(
        mesh.get_group(), SEQ_DIM, _CPU_BWD, grad_out=grad_out, grad_out_name="grad_out", query=query, key=key,
        value=value, out=out, logsumexp=logsumexp, is_causal=is_causal, dropout_p=dropout_p, scale=scale)


def _handler(op_call, args, kwargs):
    """torch's `_sdpa_handler` (`_attention.py:897`) for the CPU kernel: unwrap, propagate, ring, wrap."""
    from torch.distributed.tensor import DTensor

    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(op_info)
    sharding = op_info.output_sharding
    if sharding is None or sharding.needs_redistribute:
        raise AssertionError("context parallelism expects q, k, v sharded on the sequence")
    ring = _ring_forward if op_call is _CPU_FWD else _ring_backward
    local = ring(op_info.compute_mesh, *op_info.local_args, **op_info.local_kwargs)
    return dispatcher.wrap(local, sharding.output_spec)


def enable_cpu_kernel() -> None:
    """Register the CPU kernel's sequence-sharded strategies and add its handlers to the dict torch's context
    installs (`_attention.py:947`, `existing_custom_ops`, which `_enable_cp_dtensor_dispatcher` merges with its
    own each time the context opens). Idempotent."""
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor._ops.utils import register_op_strategy
    from torch.distributed.tensor.experimental._context_parallel import _attention

    if _CPU_FWD in _attention.existing_custom_ops:
        return
    register_op_strategy(_CPU_FWD, schema_info=RuntimeSchemaInfo(3, static_kwargkey=["scale"]))(_forward_strategy)
    register_op_strategy(_CPU_BWD, schema_info=RuntimeSchemaInfo(6, static_kwargkey=["scale"]))(_backward_strategy)
    _attention.existing_custom_ops[_CPU_FWD] = _handler
    _attention.existing_custom_ops[_CPU_BWD] = _handler


def attach_mask_hooks(model) -> None:
    """accelerate 1.15's `_attach_context_parallel_hooks` (`big_modeling.py:787-848`, what `Accelerator._prepare_cp`
    runs on the model): a pre-hook on every `self_attn` that drops the attention mask and passes `is_causal=True`
    (the sharded, load-balanced position ids look like packed sequences to transformers' mask builder)."""
    from accelerate.big_modeling import _attach_context_parallel_hooks

    _attach_context_parallel_hooks(model)


def shard_inputs(mesh, ids: torch.Tensor):
    """The context the HF Trainer enters for a step (transformers 5.23 `trainer.py:2393-2487`,
    `_prepare_context_parallel_inputs`, then accelerate's `maybe_context_parallel` = torch's `context_parallel` on the
    "cp" mesh after `set_rotate_method("allgather")`, accelerate's default `cp_comm_strategy`) and this rank's shards
    of its buffers: input ids, labels (the collator's copy of the ids), the labels shifted by one (`shift_labels`)
    and the position ids, each sharded along dim 1 with torch's head-tail load balancer. Returns (context, inputs):
    the shards are the model's keyword arguments inside the context (`context_parallel` resizes the buffers in
    place, `no_restore_buffers` all of them)."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    set_rotate_method("allgather")
    inputs = {"input_ids": ids.clone(), "labels": ids.clone()}
    inputs["shift_labels"] = torch.nn.functional.pad(inputs["labels"], (0, 1), value=-100)[:, 1:].contiguous()
    inputs["position_ids"] = torch.arange(ids.size(1), device=ids.device).expand(ids.size(0), -1)
    buffers = list(inputs.values())
    ctx = context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers), no_restore_buffers=set(buffers))
    return ctx, inputs
