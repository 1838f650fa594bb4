"""Communication buffers of the data-parallel schemes (torch 2.13 DDP and FSDP2), each named after the tensor that
allocates it and its source in torch.

DDP (and ZeRO-1, which runs under DDP):
  bucket tensors  `torch/csrc/distributed/c10d/reducer.cpp: Reducer::initialize_buckets` allocates one flat
                  gradient bucket per bucket group at construction: together one full copy of the gradients in the
                  parameters' dtype, alive for the whole run (`gradient_as_bucket_view=False`: `.grad` on top).
FSDP2 (`fully_shard`, torch/distributed/fsdp/_fully_shard), A = one decoder layer's parameters all-gathered (padded
to dp rows per tensor, in `MixedPrecisionPolicy.param_dtype`), R = the root's (embeddings, final norm, lm_head):
  all_gather_output  `_fsdp_collectives.py: foreach_all_gather` allocates world × padded-shard elements (the
                  all-gather input is a narrow view into it); `wait_for_unshard` copies it out into the unsharded
                  parameters (`FSDPParam.init_unsharded_param`, storage re-allocated with `resize_`), so a gather
                  briefly holds 2A. In forward the output is kept in `comm_ctx.all_gather_state` until the next
                  group's copy-out has returned, and the last one until the root's post-forward (`_fsdp_state.py:
                  _post_forward`), i.e. through the loss: one retained A at the loss forward.
  unsharded params ZeRO-3 frees a layer's after its forward (`reshard`), ZeRO-2 keeps them to its backward. The
                  root: ZeRO-2 keeps its to the end of backward; ZeRO-3 passes `reshard_after_forward=True` explicitly,
                  so `_lazy_init` keeps the root's post-forward reshard (it sets `post_forward_mesh_info=None` only
                  when the option is left unset): the root is freed after the loss and all-gathered again in its
                  pre-backward, at the start of backward.
  prefetch        the backward pre-hook of a group all-gathers the next group in reverse forward order
                  (`_backward_prefetch`): from the start of backward (root pre-backward prefetches the last layer)
                  one all-gather output A waits for its copy-out (ZeRO-3; under ZeRO-2 the layers are gathered).
  unsharded grads  autograd's gradients of the unsharded parameters, in param_dtype, until `post_backward`.
  reduce_scatter_input `_fsdp_collectives.py: foreach_reduce` allocates world × padded-shard elements in
                  `reduce_dtype` (fp32 under mixed precision) and copies the unsharded grads in; it is kept in
                  `comm_ctx.reduce_scatter_states` until the next group's post-backward (one buffer,
                  `reduce_scatter_max_input_buffers=1`) and the last one until the root's final callback.
  gloo flat output (CPU profile) gloo's all-gather copies through a flat world × chunk tensor allocated on the
                  calling thread (`gloo_all_gather_flat_output_bytes`): A beside the new output A during a gather.
  gloo scratch     (CPU profile) the gloo backend has no native reduce-scatter: `reduce_scatter_tensor` all-reduces
                  a copy of the whole input (`empty_strided` on the calling thread, freed on gloo's worker
                  thread) and copies this rank's chunk out; NCCL (CUDA profile) reduce-scatters in place.
  Shard(1) copies  (`--fsdp-shard dim1-if-short`) `foreach_all_gather_copy_out` gathers a tensor sharded on dim > 0
                  into a `torch.empty_like` temporary of its unsharded size and chunk-cats it into the parameter:
                  the temporaries of the group stay until the copy-out returns (D beside 2A). `foreach_reduce`
                  replaces each such gradient with `torch.cat(torch.chunk(grad, world, dim), dim=0)`, one at a
                  time; its loop variables keep the last one's original until the function returns (through the
                  copy-in and the collective).
  root gradients   the root's post-backward runs in the final callback (its inputs need no grad), so the lm_head,
                  final-norm and embedding gradients stay unsharded in param_dtype until the end of backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from llmem.components import lora, lora_copies_fsdp, quant
from llmem.components.sharding import FSDP_SCHEMES, shard_summary
from llmem.plan import Scheme, TrainingPlan
from llmem.spec import ModelSpec, per_spec


def ddp_bucket_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """`Reducer` bucket tensors: one gradient copy, standing."""
    if plan.scheme not in (Scheme.DDP, Scheme.ZERO1):
        return 0
    if lora.is_lora(plan):  # the Reducer buckets only parameters that require grad: the fp32 adapters
        return lora.adapter_bytes(spec, plan)
    return spec.total_params * plan.precision.param_bytes


def ddp_rebuild_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Bytes beyond the standing buckets while `Reducer::rebuild_buckets` runs: one more set of buckets when the old
    ones outlive it, else 0.

    DDP's `_pre_forward` (torch/nn/parallel/distributed.py: `self.reducer._rebuild_buckets()`) rebuilds once, in the
    first forward after a backward: iteration 2's forward, or with `--grad-accum K > 1` micro-step 2's forward of
    iteration 1. `Reducer::initialize_buckets` (torch/csrc/distributed/c10d/reducer.cpp) drops the old buckets
    (`buckets_.clear()`) before allocating the new contents, so the old storage survives only where a `.grad` still
    views it: `gradient_as_bucket_view=True` with the gradients alive, i.e. K > 1 (with K = 1 `zero_grad(set_to_none)`
    has dropped the views). `initialize_bucket_views` then copies each `.grad` into its new bucket view and points it
    there; the old bucket goes with its last view (one bucket: without `find_unused_parameters` the initial assignment
    is unbounded, torch/nn/parallel/distributed.py `compute_bucket_size_limits` returns `[sys.maxsize]`).
    `--keep-grads` (`zero_grad(set_to_none=False)` zeroes each `.grad` in place, so it still views the old bucket):
    the same at iteration 2's forward, when K = 1."""
    if not (plan.ddp_bucket_view and (plan.grad_accum > 1 or plan.keep_grads)):
        return 0
    return ddp_bucket_bytes(spec, plan)


def standing_buffer_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Buffers alive through the whole iteration."""
    return ddp_bucket_bytes(spec, plan)


def gather_bytes(plan: TrainingPlan) -> int:
    """Bytes per element of all-gathered parameters: the MixedPrecisionPolicy's param_dtype, else the params'."""
    return plan.precision.compute_bytes if plan.precision.is_mixed else plan.precision.param_bytes


def reduce_bytes(plan: TrainingPlan) -> int:
    """Bytes per element of the reduce-scatter input: `reduce_dtype` (fp32) under mixed precision."""
    return 4 if plan.precision.is_mixed else plan.precision.param_bytes


def layer_unsharded_bytes(spec: ModelSpec, plan: TrainingPlan, layer: int | None = None) -> int:
    """A: decoder layer `layer`'s all-gather output (padded) — also the size of its unsharded parameters' storage;
    `layer` None: the largest layer's (a bound where the layer is not known). Each group gathers its own tensors
    (`FSDPParamGroup.unshard` -> `foreach_all_gather(self.fsdp_params, ...)`, torch 2.13
    `_fully_shard/_fsdp_param_group.py:407`), so layers of several sizes (DeepSeek's dense first layers, Qwen3-MoE's
    `mlp_only_layers`) gather their own. LoRA: the frozen base and the fp32 adapters in one group; when their dtypes
    differ (pure bf16/fp16 base) `foreach_all_gather` gathers them as bytes (a uint8 buffer), so A is the sum of both.
    QLoRA: the base's share is its packed 4-bit codes (`quant.fsdp_layer_base_bytes`)."""
    each = layers_unsharded_bytes(spec, plan)
    return max(each, default=0) if layer is None else each[layer]


@per_spec("layout_key")
def layers_unsharded_bytes(spec: ModelSpec, plan: TrainingPlan) -> tuple[int, ...]:
    """`layer_unsharded_bytes` of each decoder layer."""
    layers = range(spec.num_layers)
    if quant.is_qlora(plan):  # the packed uint8 codes, the norm weights and the adapters, gathered as bytes
        base = [quant.fsdp_layer_base_bytes(spec, plan, k, gathered=True) for k in layers]
    else:
        base = [n * gather_bytes(plan) for n in shard_summary(spec, plan).gathered_layers]
    return tuple(b + _adapter_gather_bytes(spec, plan, k) for k, b in zip(layers, base, strict=True))


def _adapter_gather_bytes(spec: ModelSpec, plan: TrainingPlan, layer: int | None) -> int:
    if not lora.is_lora(plan):
        return 0
    dtype_bytes = plan.precision.compute_bytes if plan.precision.is_mixed else lora.adapter_elem_bytes(spec)
    return lora.gathered_adapter_numel(spec, plan, layer) * dtype_bytes


@per_spec("layout_key")
def root_unsharded_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """R: the root group's unsharded parameters."""
    return shard_summary(spec, plan).gathered_outer * gather_bytes(plan) + _adapter_gather_bytes(spec, plan, None) \
        + lora_copies_fsdp.gathered_copy_bytes(spec, plan)  # PEFT's module copies (`lora_copies_fsdp`)


def layer_reduce_scatter_input_bytes(spec: ModelSpec, plan: TrainingPlan, layer: int | None = None) -> int:
    """Decoder layer `layer`'s `reduce_scatter_input` (padded, reduce dtype; None: the largest layer's). LoRA:
    `foreach_reduce` gets only the gradients that exist, the adapters' (fp32: the reduce dtype under mixed
    precision, their own dtype otherwise); the frozen base has none."""
    each = layers_reduce_scatter_input_bytes(spec, plan)
    return max(each, default=0) if layer is None else each[layer]


@per_spec("layout_key")
def layers_reduce_scatter_input_bytes(spec: ModelSpec, plan: TrainingPlan) -> tuple[int, ...]:
    """`layer_reduce_scatter_input_bytes` of each decoder layer."""
    if lora.is_lora(plan):
        return tuple(lora.gathered_adapter_numel(spec, plan, k) * 4 for k in range(spec.num_layers))
    return tuple(n * reduce_bytes(plan) for n in shard_summary(spec, plan).gathered_layers)


@per_spec("layout_key")
def root_reduce_scatter_input_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """LoRA: the root's adapters only (none on the llama-like families: the lm_head is never adapted), and with no
    gradient in the group `post_backward` runs no reduce-scatter at all."""
    if lora.is_lora(plan):
        return lora.gathered_adapter_numel(spec, plan, None) * 4 \
            + lora_copies_fsdp.copy_reduce_scatter_input_bytes(spec, plan)
    return shard_summary(spec, plan).gathered_outer * reduce_bytes(plan)


def reduce_scatter_scratch_bytes(spec: ModelSpec, plan: TrainingPlan, root: bool = False,
                                 layer: int | None = None) -> int:
    """gloo's copy of the reduce-scatter input (CPU profile only), the root's or decoder layer `layer`'s."""
    from llmem.plan import Device

    if plan.scheme not in FSDP_SCHEMES or plan.device is not Device.CPU:
        return 0
    return root_reduce_scatter_input_bytes(spec, plan) if root else layer_reduce_scatter_input_bytes(spec, plan, layer)


def gathered_parameter_bytes(spec: ModelSpec, plan: TrainingPlan) -> Callable[[int], int]:
    """f(n): unsharded parameter bytes (root + layers) once n decoder layers have run forward."""
    if plan.scheme not in FSDP_SCHEMES:
        return lambda n: 0
    each, root = layers_unsharded_bytes(spec, plan), root_unsharded_bytes(spec, plan)
    if plan.scheme is Scheme.ZERO2:
        return lambda n: root + sum(each[:n])
    return lambda n: root + (each[n - 1] if n else 0)


@per_spec("layout_key")
def forward_gather_bytes(spec: ModelSpec, plan: TrainingPlan, in_layer: bool) -> int:
    """At the end of forward — inside the last decoder layer (`in_layer`) or at the loss, after ZeRO-3 resharded
    it: unsharded parameters plus the retained all-gather output of the last layer (`comm_ctx.all_gather_state`)."""
    if plan.scheme not in FSDP_SCHEMES:
        return 0
    each, root = layers_unsharded_bytes(spec, plan), root_unsharded_bytes(spec, plan)
    a = each[-1] if each else 0  # the last layer's
    if plan.scheme is Scheme.ZERO2:
        return root + sum(each) + a
    return root + (a if in_layer else 0) + a


@per_spec("layout_key")
def backward_gather_bytes(spec: ModelSpec, plan: TrainingPlan, layer: int | None, own: bool = True) -> int:
    """During the backward of decoder layer `layer` (None: the loss / lm_head, before any layer): the root,
    the layer's own unsharded parameters (`own`; False once `post_backward` resharded them), the layers still
    gathered (ZeRO-2) and the prefetched all-gather output of the next layer backward runs (ZeRO-3), each at its
    own size."""
    if plan.scheme not in FSDP_SCHEMES:
        return 0
    each, root = layers_unsharded_bytes(spec, plan), root_unsharded_bytes(spec, plan)
    if layer is None:  # the root's pre-backward prefetched the last layer
        return root + (sum(each) if plan.scheme is Scheme.ZERO2 else (each[-1] if each else 0))
    earlier = sum(each[:layer]) if plan.scheme is Scheme.ZERO2 else (each[layer - 1] if layer > 0 else 0)
    return root + (each[layer] if own else 0) + earlier


def gloo_all_gather_flat_output_bytes(spec: ModelSpec, plan: TrainingPlan, root: bool = False,
                                      layer: int | None = None) -> int:
    """(CPU profile) gloo's flat copy of a layer's (`root`: the root's) all-gather output:
    `ProcessGroupGloo::_allgather_base` chunks the output into one view per rank and runs `allgather`, whose
    `AsyncAllgatherWork::getOutputTensors` returns `newLikeFlat(outputs[0])` (world × chunk elements, A bytes) on the
    calling thread while the collective is enqueued; it is freed before the call returns. NCCL (CUDA profile)
    gathers into the output directly."""
    from llmem.plan import Device

    if plan.scheme not in FSDP_SCHEMES or plan.device is not Device.CPU:
        return 0
    return root_unsharded_bytes(spec, plan) if root else layer_unsharded_bytes(spec, plan, layer)


@per_spec("layout_key")
def pre_backward_gather_bytes(spec: ModelSpec, plan: TrainingPlan, layer: int) -> int:
    """ZeRO-3, in decoder layer `layer`'s pre-backward (`FSDPParamGroup.pre_backward`: `unshard`,
    `wait_for_unshard`, then `_backward_prefetch`, torch 2.13 `_fully_shard/_fsdp_param_group.py:576-586`): the
    root's unsharded parameters, the layer's copy-out (its new unsharded storage beside its prefetched all-gather
    output, 2 A_l, and the copy-out's Shard(1) temporaries, `shard_dim1_copy_out_bytes`) and then, for layer > 0,
    once that output is freed, the prefetch of layer - 1 (`_backward_prefetch`): its all-gather output A_(l-1)
    beside A_l, with gloo's flat output during that all-gather (`gloo_all_gather_flat_output_bytes`) and, under a
    MixedPrecisionPolicy, its input (`all_gather_input_copy_bytes`); the larger of the two."""
    if plan.scheme not in FSDP_SCHEMES or plan.scheme is Scheme.ZERO2:
        return 0
    a, root = layer_unsharded_bytes(spec, plan, layer), root_unsharded_bytes(spec, plan)
    copy_out = 2 * a + shard_dim1_copy_out_bytes(spec, plan, layer=layer)  # Shard(1) temporaries: the copy-out only
    if layer == 0:
        return root + copy_out
    return root + max(copy_out, a + all_gather_bytes(spec, plan, layer=layer - 1))


def all_gather_input_copy_bytes(spec: ModelSpec, plan: TrainingPlan, root: bool = False,
                                layer: int | None = None) -> int:
    """Under a MixedPrecisionPolicy, decoder layer `layer`'s (`root`: the root's) all-gather input:
    `_get_param_all_gather_inputs` casts the group's sharded parameters into one new flat param_dtype tensor
    (`flat_foreach_copy_input`, A / dp bytes), and `foreach_all_gather` keeps views of it (`all_gather_inputs`) until
    it returns, through the collective. Without a policy the inputs are views of the sharded parameters (nothing
    allocated)."""
    if plan.scheme not in FSDP_SCHEMES or not plan.precision.is_mixed:
        return 0
    return (root_unsharded_bytes(spec, plan) if root else layer_unsharded_bytes(spec, plan, layer)) // plan.dp


@per_spec("layout_key")
def all_gather_bytes(spec: ModelSpec, plan: TrainingPlan, root: bool = False, layer: int | None = None) -> int:
    """Inside one group's `foreach_all_gather` (`root`: the root's, else decoder layer `layer`'s): its new all-gather
    output (A or R), its flat half input copy under a MixedPrecisionPolicy and, on CPU, gloo's flat output, all alive
    through the collective (the copy-out into the unsharded parameters follows in `wait_for_unshard`)."""
    if plan.scheme not in FSDP_SCHEMES:
        return 0
    output = root_unsharded_bytes(spec, plan) if root else layer_unsharded_bytes(spec, plan, layer)
    return (output + all_gather_input_copy_bytes(spec, plan, root, layer)
            + gloo_all_gather_flat_output_bytes(spec, plan, root, layer))


def _group_shapes(spec: ModelSpec, plan: TrainingPlan, root: bool, trainable_only: bool = False,
                  layer: int = 0) -> list[tuple]:
    """The (TP-local) shapes of one FSDP2 group's tensors — decoder layer `layer`'s, or the root's — in registration
    order; LoRA: the frozen base's, then the adapters' (`trainable_only`: the adapters' alone, the tensors that
    have gradients)."""
    from llmem.components.sharding import tp_local_shape

    params = spec.outer_params if root else spec.layer_params(layer)
    frozen = lora.is_lora(plan)
    shapes = [] if frozen and trainable_only else [tp_local_shape(p, plan.tp) for p in params]
    if frozen:
        shapes += [a.shape for a in lora.adapter_params(spec, plan) if a.layer == (None if root else layer)]
    return shapes


def _largest(term: Callable, spec: ModelSpec, plan: TrainingPlan, root: bool, layer: int | None) -> int:
    """A group's term: the root's, decoder layer `layer`'s, or (None) the largest layer's."""
    if root or layer is not None:
        return term(spec, plan, root, layer or 0)
    return max((term(spec, plan, False, k) for k in range(spec.num_layers)), default=0)


@per_spec("layout_key")
def _dim1_gathered_numels(spec: ModelSpec, plan: TrainingPlan, root: bool, trainable_only: bool = False,
                          layer: int = 0) -> tuple:
    """Unsharded elements of the group's tensors that FSDP2 shards on dim 1, in registration order."""
    if plan.scheme not in FSDP_SCHEMES:
        return ()
    from llmem.components.sharding import fsdp_shard_dim

    shapes = _group_shapes(spec, plan, root, trainable_only, layer)
    return tuple(math.prod(s) for s in shapes if fsdp_shard_dim(s, plan))


@per_spec("layout_key")
def shard_dim1_copy_out_bytes(spec: ModelSpec, plan: TrainingPlan, root: bool = False,
                              layer: int | None = None) -> int:
    """D: `foreach_all_gather_copy_out`'s `empty_like` temporaries of a group's dim-1-sharded tensors (param dtype),
    beside its all-gather output and new unsharded parameters (`_fsdp_collectives.py`, torch 2.13)."""
    return _largest(lambda s, p, r, k: sum(_dim1_gathered_numels(s, p, r, layer=k)) * gather_bytes(p),
                    spec, plan, root, layer)


@per_spec("layout_key")
def shard_dim1_reduce_bytes(spec: ModelSpec, plan: TrainingPlan, root: bool = False, layer: int | None = None) -> int:
    """`foreach_reduce`: the original unsharded gradient of the group's last dim-1-sharded tensor that has one (the
    spec's tensors, and PEFT's adapters, follow the modules' registration order), kept by the loop's variables
    beside its `torch.cat` replacement until the function returns. LoRA: only the adapters have gradients."""
    def term(s: ModelSpec, p: TrainingPlan, r: bool, k: int) -> int:
        numels = _dim1_gathered_numels(s, p, r, True, k)
        return (numels[-1] if numels else 0) * gather_bytes(p)
    return _largest(term, spec, plan, root, layer)


@per_spec("layout_key")
def chunk_cat_padding_bytes(spec: ModelSpec, plan: TrainingPlan, root: bool = False, layer: int | None = None) -> int:
    """(CPU profile) `foreach_reduce_scatter_copy_in` calls `torch._chunk_cat(grads, 0, world, out=...)`. On CPU that
    is the composite `at::native::_chunk_cat_out`, whose `_pad_chunk` copies every gradient whose dim 0 does not
    divide by the ranks into a `new_zeros` tensor of the padded size (grad dtype) and keeps them until the cat;
    CUDA's `_chunk_cat_out_cuda` pads inside its kernel for contiguous inputs (ATen native/cuda/TensorShape.cu).
    One decoder layer's gradients (LoRA: the adapters'), or the root's; Shard(1) gradients arrive re-chunked with
    w x d0 rows."""
    from llmem.components.sharding import fsdp_shard_dim
    from llmem.plan import Device

    if plan.scheme not in FSDP_SCHEMES or plan.device is not Device.CPU:
        return 0
    if lora.is_lora(plan):
        elem = plan.precision.compute_bytes if plan.precision.is_mixed else lora.adapter_elem_bytes(spec)
    else:
        elem = gather_bytes(plan)

    def term(s: ModelSpec, p: TrainingPlan, r: bool, k: int) -> int:
        shapes = _group_shapes(s, p, root=r, trainable_only=True, layer=k)
        return sum(-(-x[0] // p.dp) * p.dp * math.prod(x[1:]) for x in shapes
                   if x[0] % p.dp and not fsdp_shard_dim(x, p)) * elem
    return _largest(term, spec, plan, root, layer)


def root_resharded_after_forward(plan: TrainingPlan) -> bool:
    """ZeRO-3 (and TP × FSDP2) pass `reshard_after_forward=True` to `fully_shard` explicitly, so the root's
    `_lazy_init` keeps its post-forward reshard (it drops it only when the option was left unset): the root frees its
    unsharded parameters after the loss and all-gathers them again in its pre-backward."""
    return plan.scheme in FSDP_SCHEMES and plan.scheme is not Scheme.ZERO2


def backward_transient_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """FSDP2 reduce-scatter input of one layer: its unsharded gradients in the reduce dtype."""
    if plan.scheme not in FSDP_SCHEMES:
        return 0
    return layer_reduce_scatter_input_bytes(spec, plan)
