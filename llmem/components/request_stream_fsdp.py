"""FSDP2's program (`fully_shard` per decoder layer, then on the model: ZeRO-2, ZeRO-3, TP × FSDP2) as the request
stream `request_stream` replays through the caching-allocator model, each request on the stream FSDP2 allocates
it on. The allocator keeps a pool per stream: a freed block serves only requests of the stream that allocated it
(c10/cuda/CUDACachingAllocator.cpp at torch 2.13, its header: "Once freed, blocks can be re-allocated on the same
stream, but not on any other stream"; `Block::stream`, the allocation stream; `BlockComparatorSize` orders by
stream first, and `get_free_block` searches from a key of the request's own stream), so FSDP2's side-stream buffers
never reuse the default stream's blocks nor the other way round (docs/notes/2026-11-27-fsdp2-request-stream.md).

Streams (torch/distributed/fsdp/_fully_shard at 2.13): 0 the default; 1 `all_gather_copy_in_stream`
(_fsdp_collectives.py:336, `foreach_all_gather`: the mixed-precision input copy and the all-gather output are
allocated under `device_handle.stream(all_gather_copy_in_stream)`); 2 `reduce_scatter_stream` (`foreach_reduce`:
the reduce-scatter output, _fsdp_collectives.py:611-612, of which the sharded gradients are views, alive until
`zero_grad`). The reduce-scatter input (_fsdp_collectives.py:597, before the stream switch) and the unsharded
parameters (`wait_for_unshard`'s copy-out) are on the default stream; the previous group's all-gather output is
freed at the next `wait_for_unshard` (`comm_ctx.all_gather_state`, _fsdp_param_group.py:430-432, 483).

Requests per phase (group = a decoder layer, or the root: embedding, final norm, untied lm_head):
  build     every parameter in full, `model.parameters()` order (as `request_stream`); TP × FSDP2 then TP's
            `distribute_tensor` (`request_stream._distribute`).
  wrap      per group, layers first then the root: each parameter's padded dim-0 shard (`FSDPParam
            ._init_sharded_param`: `new_zeros` of the padded chunk, param dtype), then the group's full tensors freed.
  forward   the root's all-gather (input copy, output, input freed; stream 1) and copy-out (each unsharded
            parameter, unpadded, param_dtype); per layer its all-gather, copy-out, then the previous group's
            all-gather output freed (`comm_ctx.all_gather_state`: kept until the next all-gather's copy-out), the
            layer's saved tensors and RMSNorm's fp32 `pow`; ZeRO-3 frees the layer's unsharded parameters after it.
            The embedding output is freed after the final norm (nothing saves it).
  loss      logits, fp32 upcast, log_softmax (as `request_stream`, no autocast copy); ZeRO-3 frees the root's
            unsharded parameters (reshard after forward), then the last layer's all-gather output.
  backward  ZeRO-3: the root's all-gather and copy-out, its output freed, the last layer's all-gather prefetched
            (`_backward_prefetch`); the loss's fp32 gradients, the lm_head's gradient in param_dtype. Per layer, last
            first: (ZeRO-3) copy-out of the prefetched all-gather, its output freed, the next layer's prefetched;
            each parameter's gradient (param_dtype, unpadded); the saved tensors freed; `post_backward`: the
            unsharded parameters freed (reshard), the previous reduce-scatter input freed, the layer's allocated
            (`foreach_reduce`, reduce dtype, padded, default stream), its gradients freed, the reduce-scatter output
            (stream 2). The root last: `embedding_dense_backward` (a tied weight's accumulated into the lm_head's,
            `add`), then the same `post_backward`; the last reduce-scatter input freed at the end of backward.
  step      foreach AdamW over the sharded fp32 parameters (`request_stream._step`); `zero_grad` frees the
            reduce-scatter outputs and the logits.
"""

from __future__ import annotations

import math

from llmem.components import communication as comm
from llmem.components.request_events import layer_kinds
from llmem.components.sharding import local_numel, tp_local_shape, unsharded_numel
from llmem.plan import Scheme, TrainingPlan
from llmem.spec import ModelSpec

GATHER, REDUCE = 1, 2  # all_gather_copy_in_stream, reduce_scatter_stream


class _Group:
    """One FSDP2 group's request sizes (bytes): `shards` (param dtype, padded), `copy_out` and `grads` (param_dtype,
    unpadded, TP-local), the all-gather input copy and output, the reduce-scatter input and output."""

    def __init__(self, params: list, plan: TrainingPlan, root: bool, spec: ModelSpec) -> None:
        gather, reduce = comm.gather_bytes(plan), comm.reduce_bytes(plan)
        self.shards = [local_numel(p, plan) * plan.precision.param_bytes for p in params]
        self.copy_out = [math.prod(tp_local_shape(p, plan.tp)) * gather for p in params]
        self.grads = self.copy_out
        padded = sum(unsharded_numel(p, plan) for p in params)
        local = sum(local_numel(p, plan) for p in params)
        self.gather_in = comm.all_gather_input_copy_bytes(spec, plan, root) and local * gather
        self.gather_out = padded * gather
        self.rs_in, self.rs_out = padded * reduce, local * reduce


def groups(spec: ModelSpec, plan: TrainingPlan, order: list) -> tuple[list[_Group], _Group, list]:
    """The layers' groups (one per kind of layer, `layer_kinds`), the root's, and the root's parameters (registration
    order)."""
    by_kind: dict = {}
    layers = []
    for i, kind in enumerate(layer_kinds(spec)):
        if kind not in by_kind:
            by_kind[kind] = _Group(spec.layer_params(i), plan, False, spec)
        layers.append(by_kind[kind])
    root_params = [p for p in order if p.layer is None]
    return layers, _Group(root_params, plan, True, spec), root_params


def wrap(req, spec: ModelSpec, plan: TrainingPlan, order: list, built: list[int]) -> None:
    """`fully_shard` per layer, then the root: each group's shards allocated, then its full tensors freed."""
    key = dict(zip(map(id, order), built, strict=True))
    layers, root, root_params = groups(spec, plan, order)
    for g, params in [*((layers[i], spec.layer_params(i)) for i in range(spec.num_layers)), (root, root_params)]:
        req.allocs(g.shards)
        req.free(*(key[id(p)] for p in params))


def _all_gather(req, g: _Group) -> int:
    """`foreach_all_gather` on stream 1: the input copy, the output; the input freed once the collective returns."""
    cast = req.alloc(g.gather_in, GATHER)
    out = req.alloc(g.gather_out, GATHER)
    req.free(cast)
    return out


def _copy_out(req, g: _Group) -> list[int]:
    return req.allocs(g.copy_out)


def forward(req, spec: ModelSpec, plan: TrainingPlan, sizes, layers: list[_Group], root: _Group):
    """The root's and each layer's unshard, the layers' kept tensors; returns (kept per layer, the root's unsharded
    parameters, the layers' (ZeRO-2; ZeRO-3 unshards them again in the backward), the last all-gather output)."""
    out = _all_gather(req, root)
    root_params = _copy_out(req, root)
    embed = req.alloc(sizes.residual)
    kept, unsharded = [], []
    for i, g in enumerate(layers):
        out, params, saved = _forward_layer(req, out, g, plan, sizes, i)
        kept.append(saved)
        unsharded.append(params)
    req.free(embed)
    return kept, root_params, unsharded, out


def _forward_layer(req, prev: int, g: _Group, plan: TrainingPlan, sizes, i: int) -> tuple[int, list[int], list[int]]:
    """A layer's unshard (the previous group's all-gather output `prev` freed), its forward, ZeRO-3's reshard;
    returns (its all-gather output, its unsharded parameters (ZeRO-3: [], resharded), the keys kept to its
    backward)."""
    out = _all_gather(req, g)
    params = _copy_out(req, g)
    req.free(prev)
    kept = _layer_forward(req, plan, sizes, i)
    if plan.scheme is Scheme.ZERO2:
        return out, params, kept
    req.free(*params)
    return out, [], kept


def backward(req, spec: ModelSpec, plan: TrainingPlan, sizes, state, layers: list[_Group], root: _Group) -> list:
    """Loss forward and backward, then the layers' and the root's; returns the keys `zero_grad` frees (the
    logits, the reduce-scatter outputs)."""
    kept, root_params, unsharded, out = state
    zero3 = plan.scheme is not Scheme.ZERO2
    half, l32 = sizes.half, sizes.l32
    logits = req.alloc(half)
    upcast = req.alloc(l32) if sizes.upcast else 0
    lsm = req.alloc(l32)
    req.free(upcast)
    if zero3:
        req.free(*root_params)
    req.free(out)
    if zero3:  # the root's pre-backward: unshard, then prefetch the last layer
        gathered = _all_gather(req, root)
        root_params = _copy_out(req, root)
        req.free(gathered)
        out = _all_gather(req, layers[-1])
    g_nll = req.alloc(l32)
    g_lsm = req.alloc(l32)
    req.free(g_nll, lsm)
    g_half = req.alloc(half) if sizes.upcast else 0
    req.free(g_lsm)
    head = root.grads[0]  # the lm_head's gradient: the embedding's shape (tied or not)
    g_head = req.alloc(head)
    g_in = req.alloc(sizes.g_in)
    req.free(g_half, g_in)
    held, rs_in = [logits], 0
    for i in reversed(range(spec.num_layers)):
        out, rs_in, grad = _backward_layer(req, (out, unsharded[i], kept[i], rs_in), layers, plan, sizes, i)
        held.append(grad)
    grads = [g_head]
    if spec.tie_word_embeddings:  # accumulated into the lm_head's gradient: a new sum, both freed
        dense = req.alloc(head)
        grads = [req.alloc(head)]
        req.free(g_head, dense)
    else:
        grads.append(req.alloc(root.grads[0]))
    req.free(_reduce(req, root, root_params, grads, rs_in, held))
    return held


def _backward_layer(req, given: tuple, layers: list[_Group], plan: TrainingPlan, sizes, i: int) -> tuple:
    """Layer `i`'s backward: ZeRO-3's unshard (the prefetched all-gather output freed, the next layer's prefetched),
    the recompute if checkpointed, its gradients, its saved tensors freed, `post_backward`. `given`: the prefetched
    all-gather output, the unsharded parameters (ZeRO-2), the kept tensors, the last reduce-scatter input. Returns
    (the next all-gather output, the reduce-scatter input, the reduce-scatter output)."""
    out, unsharded, kept, rs_in = given
    g = layers[i]
    if plan.scheme is not Scheme.ZERO2:
        unsharded = _copy_out(req, g)
        req.free(out)
        out = _all_gather(req, layers[i - 1]) if i else 0
    if plan.checkpointed(i):  # the recompute, after the unshard: the layer's saved tensors
        policy = kept[1:]  # selective: taken out of the cache as the recompute reaches them, but the last
        req.free(*policy[:-1] if sizes.policy_extra else policy)  # output if dispatched after the last pack
        kept = kept[:1] + (policy[-1:] if sizes.policy_extra else [])
        req.free(req.alloc(sizes.pow))
        kept += req.allocs(sizes.table)
    grads = req.allocs(g.grads[::-1])
    req.free(*reversed(kept))
    held: list = []
    rs_in = _reduce(req, g, unsharded, grads, rs_in, held)
    return out, rs_in, held[0]


def _reduce(req, g: _Group, unsharded: list[int], grads: list[int], rs_in: int, held: list) -> int:
    """`post_backward`: reshard, then `foreach_reduce` (the previous reduce-scatter input freed first); returns the
    new reduce-scatter input (freed by the next one or at the end of backward)."""
    req.free(*unsharded)
    req.free(rs_in)
    rs_in = req.alloc(g.rs_in)
    req.free(*grads)
    held.append(req.alloc(g.rs_out, REDUCE))
    return rs_in


def _layer_forward(req, plan: TrainingPlan, sizes, layer: int) -> list[int]:
    """A layer's forward: its saved tensors and RMSNorm's fp32 `pow` (freed at once); checkpointed
    (`torch.utils.checkpoint`, non-reentrant), the same tensors made and freed within the layer, and the layer's
    input (the residual stream, param_dtype) kept for the recompute; selective, also the outputs torchtitan's policy
    saves (`request_stream_ckpt.policy_sizes`, docs/notes/2026-11-28-reserved-ckpt-streams.md), given back as the
    recompute reaches them but the one dispatched after the layer's last pack. Returns the keys kept to the
    backward."""
    req.free(req.alloc(sizes.pow))
    saved = req.allocs(sizes.table)
    if not plan.checkpointed(layer):
        return saved
    req.free(*saved)
    return [req.alloc(sizes.residual)] + [req.alloc(n) for n in sizes.policy]
