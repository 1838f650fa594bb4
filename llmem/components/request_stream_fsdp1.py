"""FSDP1's program (`--engine fsdp1 --zero 3`: `FullyShardedDataParallel` FULL_SHARD as accelerate configures it,
`use_orig_params=True`, `limit_all_gathers`, BACKWARD_PRE, no forward prefetch; full fine-tuning) as the request
stream `request_stream` replays through the caching-allocator model, each request on the stream FSDP1 allocates it
on. Cached blocks serve only the stream that allocated them (c10/cuda/CUDACachingAllocator.cpp at torch 2.13:
`Block::stream`, `BlockComparatorSize` orders by stream first, `get_free_block` searches the request's stream), so
FSDP1's side-stream buffers keep pools of their own through the step (docs/notes/2026-11-28-fsdp1-reserved.md).

Streams (torch 2.13 torch/distributed/fsdp/_runtime_utils.py `_init_streams`, :255-272): 0 the default; 1
`_unshard_stream` (`_unshard`, :304-306: `FlatParamHandle.unshard` allocates the padded unsharded flat parameter,
`_alloc_padded_unsharded_flat_param`, _flat_param.py:1395); 2 `_post_backward_stream` (`_post_backward_hook`,
:755: `_reduce_grad`'s `new_sharded_grad = torch.empty_like(chunks[0])` and `_cast_grad_to_param_dtype`'s
parameter-dtype copy, kept as the sharded `.grad`); 3 `_pre_unshard_stream` (`_unshard`, :293-294:
`_use_low_precision_shard` allocates the `_mp_shard` under MixedPrecision, freed after the all-gather). The sizes are
`flat_param`'s (units, shards, padded unsharded numel).

Requests per phase (unit = a decoder layer, or the root: embeddings, final norm, untied lm_head; `flat_param.units`):
  build     every parameter in full, `model.parameters()` order (as `request_stream`).
  wrap      per unit, layers first then the root (`_recursive_wrap` wraps children first): `flatten_tensors`'
            `torch.cat` (N elements, parameter dtype), the rank's shard (`_get_shard`'s clone, S = N / W), the
            flat tensor's storage freed (`shard`, `_resize_(0)`), the original tensors freed (`_use_sharded_views`).
  forward   iteration 1: `_lazy_init` → `init_flat_param_attributes` per unit (root first): `_mp_shard`,
            `_full_param_padded` and `_full_prec_full_param_padded` made and their storage freed at once (default
            stream). The root's unshard (never resharded after forward: `_post_forward_reshard` skips the root);
            per layer its unshard, the layer's saved tensors (`request_stream_fsdp._layer_forward`), then its
            reshard (FULL_SHARD frees the unsharded flat parameter in `_post_forward`).
  loss      logits, fp32 upcast, log_softmax (as `request_stream_fsdp`).
  backward  the root's pre-backward prefetches the last layer (BACKWARD_PRE); per layer, last first, its
            pre-backward prefetches the one before it (`_prefetch_handle`), the recompute if checkpointed, each
            view's gradient (the gather dtype, unpadded), the saved tensors freed, `SplitWithSizesBackward`'s
            concatenation into the unsharded flat gradient (N), the views' gradients freed; `_post_backward_hook`:
            the unsharded parameter freed (reshard), the sharded gradient (stream 2, + its parameter-dtype cast
            under MixedPrecision), the unsharded gradient freed. The root last, after `embedding_dense_backward`.
  step      foreach AdamW over the original parameters' views of the shards (`request_stream._step`);
            `zero_grad(set_to_none)`, then the next root pre-forward frees the flat gradients
            (`_reset_flat_param_grad_info_if_needed`, _flat_param.py:2470), and the loop the logits.
"""

from __future__ import annotations

from llmem.components import flat_param as fp
from llmem.components.request_events import layer_kinds
from llmem.components.request_stream_fsdp import _layer_forward
from llmem.plan import Engine, Method, Scheme, TrainingPlan
from llmem.spec import ModelSpec

UNSHARD, POST_BACKWARD, PRE_UNSHARD = 1, 2, 3


def applies(plan: TrainingPlan) -> bool:
    """FULL_SHARD (`--zero 3`) full fine-tuning under `--engine fsdp1` (without or with full checkpointing; selective
    is refused under FSDP1): the program this stream writes out."""
    return plan.engine is Engine.FSDP1 and plan.scheme is Scheme.ZERO3 and plan.method is Method.FULL


class _Unit:
    """One FlatParameter's request sizes (bytes): its tensors' view gradients (gather dtype, registration order),
    N in the parameter and the gather dtype, the shard S in the parameter dtype and under MixedPrecision in the half
    dtype, the sharded gradient in the reduce dtype and its parameter-dtype cast (0: none)."""

    def __init__(self, spec: ModelSpec, plan: TrainingPlan, unit: int) -> None:
        u = fp.units(spec, plan)[unit]
        gather, pb = fp.gather_bytes(plan), plan.precision.param_bytes
        shard = u.shard_numel(fp.shard_world(plan))
        self.view_grads = [n * gather for _, n in u.params]
        self.flat, self.unsharded, self.shard = u.numel * pb, fp.unsharded_bytes(spec, plan)[unit], shard * pb
        mixed = plan.precision.is_mixed
        self.mp_shard = shard * plan.precision.compute_bytes if mixed else 0
        self.full_prec = u.numel * pb if mixed else 0
        self.grad_shard = shard * fp.reduce_bytes(plan)
        self.grad_cast = shard * pb if fp.reduce_bytes(plan) != pb else 0


def units(spec: ModelSpec, plan: TrainingPlan) -> tuple[_Unit, list[_Unit]]:
    """The root's unit and each decoder layer's (layers of one kind share one, `layer_kinds`)."""
    by_kind: dict = {}
    layers = []
    for i, kind in enumerate(layer_kinds(spec)):
        if kind not in by_kind:
            by_kind[kind] = _Unit(spec, plan, 1 + i)
        layers.append(by_kind[kind])
    return _Unit(spec, plan, 0), layers


def wrap(req, spec: ModelSpec, plan: TrainingPlan, order: list, built: list[int]) -> None:
    """`FullyShardedDataParallel(...)`: per unit the flat tensor, the shard, the flat tensor and the originals
    freed."""
    key = dict(zip(map(id, order), built, strict=True))
    root, layers = units(spec, plan)
    groups = [*((layers[i], spec.layer_params(i)) for i in range(spec.num_layers)),
              (root, [p for p in order if p.layer is None])]
    for u, params in groups:
        flat = req.alloc(u.flat)
        req.alloc(u.shard)
        req.free(flat, *(key[id(p)] for p in params))


def _lazy_init(req, root: _Unit, layers: list[_Unit]) -> None:
    """`init_flat_param_attributes`: each tensor allocated, then its storage freed (`_free_storage`)."""
    for u in (root, *layers):
        for n in (u.mp_shard, u.unsharded, u.full_prec):
            req.free(req.alloc(n))


def _unshard(req, u: _Unit) -> int:
    """`_unshard`: the `_mp_shard` on the pre-unshard stream, the padded unsharded flat parameter on the unshard
    stream (NCCL all-gathers into it), the `_mp_shard` freed (`post_unshard`)."""
    mp = req.alloc(u.mp_shard, PRE_UNSHARD)
    out = req.alloc(u.unsharded, UNSHARD)
    req.free(mp)
    return out


def forward(req, spec: ModelSpec, plan: TrainingPlan, sizes, first: bool) -> tuple[list, int]:
    """The root's unshard, each layer's unshard, saved tensors and reshard; returns (kept per layer, the root's
    unsharded flat parameter)."""
    root, layers = units(spec, plan)
    if first:
        _lazy_init(req, root, layers)
    root_param = _unshard(req, root)
    embed = req.alloc(sizes.residual)
    kept = [_forward_layer(req, u, plan, sizes, i) for i, u in enumerate(layers)]
    req.free(embed)
    return kept, root_param


def _forward_layer(req, u: _Unit, plan: TrainingPlan, sizes, i: int) -> list[int]:
    """A layer's unshard, forward and reshard; returns the keys kept to its backward."""
    param = _unshard(req, u)
    kept = _layer_forward(req, plan, sizes, i)
    req.free(param)
    return kept


def backward(req, spec: ModelSpec, plan: TrainingPlan, sizes, state) -> list:
    """Loss forward and backward, then the layers' and the root's; returns the keys freed after the step (the
    logits, the sharded gradients)."""
    kept, root_param = state
    root, layers = units(spec, plan)
    half, l32 = sizes.half, sizes.l32
    logits = req.alloc(half)
    upcast = req.alloc(l32) if sizes.upcast else 0
    lsm = req.alloc(l32)
    req.free(upcast)
    gathered = _unshard(req, layers[-1])  # the root's pre-backward prefetch
    g_nll = req.alloc(l32)
    g_lsm = req.alloc(l32)
    req.free(g_nll, lsm)
    g_half = req.alloc(half) if sizes.upcast else 0
    req.free(g_lsm)
    # the root's views' gradients wait in `SplitWithSizesBackward`'s input: the lm_head's (the embedding's shape,
    # tied or not) and the final norm's now, the embedding's after the layers
    head, norm = root.view_grads[0], root.view_grads[1]
    waiting = [req.alloc(head), req.alloc(norm)]
    g_in = req.alloc(sizes.g_in)
    req.free(g_half, g_in)
    held = [logits]
    for i in reversed(range(spec.num_layers)):
        gathered, grad = _backward_layer(req, (gathered, kept[i]), layers, plan, sizes, i)
        held.append(grad)
    embed = req.alloc(head)
    if spec.tie_word_embeddings:  # accumulated with the lm_head's: a new sum, both freed
        summed = req.alloc(head)
        req.free(waiting[0], embed)
        waiting[0] = summed
    else:
        waiting.append(embed)
    _post_backward(req, root, root_param, waiting, held)
    return held


def _backward_layer(req, given: tuple, layers: list[_Unit], plan: TrainingPlan, sizes, i: int) -> tuple[int, int]:
    """Layer `i`'s backward (`given`: its prefetched unsharded parameter, its kept tensors): the one before it
    prefetched, the recompute if checkpointed, the views' gradients, `_post_backward`; returns (the prefetched
    parameter, the sharded gradient)."""
    param, kept = given
    u = layers[i]
    gathered = _unshard(req, layers[i - 1]) if i else 0  # BACKWARD_PRE: the next one's, before computing
    if plan.checkpointed(i):
        kept = _recompute(req, sizes, kept)
    views = req.allocs(u.view_grads[::-1])
    req.free(*reversed(kept))
    held: list = []
    _post_backward(req, u, param, views, held)
    return gathered, held[0]


def _recompute(req, sizes, kept: list) -> list:
    """The checkpointed layer's recompute after its unshard (as `request_stream_fsdp.backward`); returns the keys
    kept to its backward."""
    policy = kept[1:]
    req.free(*policy[:-1] if sizes.policy_extra else policy)
    kept = kept[:1] + (policy[-1:] if sizes.policy_extra else [])
    req.free(req.alloc(sizes.pow))
    return kept + req.allocs(sizes.table)


def _post_backward(req, u: _Unit, param: int, views: list[int], held: list) -> None:
    """The concatenated unsharded gradient, the views' freed; `_post_backward_hook`: reshard, then on the
    post-backward stream the sharded gradient (and its parameter-dtype cast, the reduce-dtype one freed); the
    unsharded gradient freed."""
    flat = req.alloc(u.unsharded)
    req.free(*views)
    req.free(param)
    grad = req.alloc(u.grad_shard, POST_BACKWARD)
    if u.grad_cast:
        cast = req.alloc(u.grad_cast, POST_BACKWARD)
        req.free(grad)
        grad = cast
    held.append(grad)
    req.free(flat)


def program(req, spec: ModelSpec, plan: TrainingPlan, sizes, params: list, built: list[int], step):
    """FSDP1's wrap and two iterations; `step`: `request_stream._step` (foreach AdamW)."""
    wrap(req, spec, plan, params, built)
    for iteration in (1, 2):
        req.mark(f"forward {iteration}")
        state = forward(req, spec, plan, sizes, iteration == 1)
        req.mark(f"loss {iteration}")
        held = backward(req, spec, plan, sizes, state)
        req.mark(f"optimizer {iteration}")
        step(req, spec, plan, iteration == 1)
        req.free(*held)
    return req
