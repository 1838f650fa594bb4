"""The quantized frozen base of `--method qlora` (bitsandbytes 4-bit or 8-bit, `llmem.runtime.lora.quantize_base`).

Every Linear of the base but the output layer becomes a `bnb.nn.Linear4bit` whose weight is a `Params4bit`
(bitsandbytes 0.50 `functional.quantize_4bit`, blocksize 64, no double quantization):
  packed weight: uint8, ceil(numel / 2) bytes (two 4-bit codes per byte);
  absmax: fp32, one per block of 64 elements -> 4 * ceil(numel / 64) bytes;
  code: the 16-entry fp32 nf4/fp4 lookup table, a new tensor per weight (`get_4bit_type`) -> 64 bytes.
Embeddings, the output layer and the norm weights stay in the plan's dtype.

Dequantization (`MatMul4Bit`: forward `gemm_4bit`, backward `matmul(grad_output, dequantize_4bit(W))`) makes the
full weight (out, in) in the compute dtype for one Linear at a time; it is freed when the matmul returns:
  cuda: the dequantize kernel writes the compute-dtype weight directly (numel * compute bytes);
  cpu: bitsandbytes' default implementation `_dequantize_4bit_compute` is wrapped in `torch.compile`, whose fused
  kernel allocates only its output, numel * compute bytes as well (measured). Where compilation fails (no C++
  compiler) bitsandbytes falls back to eager code with int32/fp32 intermediates (up to 8-10 B/elem): not modelled.
The largest such moment in a layer's backward: the dequantized weight, the Linear's output gradient and the input
gradient the matmul writes (`dequant_moment_bytes`); in the forward: the weight and the Linear's output.
"""

from __future__ import annotations

from llmem.components.saved import FP32
from llmem.plan import Device, GradCkpt, Method, Precision, Quant, TrainingPlan
from llmem.spec import ModelSpec, ParamTensor, per_spec

BLOCKSIZE = 64
CODE_BYTES = 16 * 4
FP16 = 2
INT32 = 4
INT8_THRESHOLD = 6.0  # BitsAndBytesConfig.llm_int8_threshold default: outlier columns kept in 16-bit
# Outlier columns assumed in `MatMul8bitLt` (see the 8-bit section below): none. Values with |x| >= 6.0 in a Linear's
# fp16 input select whole columns; at a randomly initialised model the inputs are RMS-normalised (|x| >= 6 has a
# probability ~2e-9 per element) or products of them, so there are none in practice; trained models above ~6.7B
# parameters have a few (LLM.int8 paper, Dettmers et al. 2022: a handful of hidden dimensions). Each outlier column
# adds tokens * cb (subA, kept until the outputs are dropped) + out * (1 + 4 + cb) transient bytes (subB), see
# `outlier_column_bytes`.
OUTLIER_COLUMNS = 0


def is_qlora(plan: TrainingPlan) -> bool:
    return plan.method is Method.QLORA


def is_int8(plan: TrainingPlan) -> bool:
    return plan.method is Method.QLORA and plan.quant is Quant.INT8


def quantized_weights(spec: ModelSpec, plan: TrainingPlan) -> list[ParamTensor]:
    """The base weights that are stored quantized (every Linear but the output layer)."""
    from llmem.components.lora import linear_weights

    if not is_qlora(plan):
        return []
    if spec.derived is None:
        return linear_weights(spec)
    return spec.memo(("quant.traced_weights",), lambda: _converted(spec))


def _converted(spec: ModelSpec) -> list[ParamTensor]:
    """A traced spec's Linears that transformers' replacement converts (`llmem.derive.quant.unconverted_linears`:
    subclasses of nn.Linear, e.g. falcon's FalconLinear, and a mixture of experts' router modules stay in the plan's
    dtype, as do its fused 3-D experts, which are not Linears)."""
    from llmem.components.lora import linear_weights
    from llmem.derive.quant import unconverted_linears

    kept = unconverted_linears(spec.derived.config)
    return [p for p in linear_weights(spec) if p.name.removesuffix(".weight").rsplit(".", 1)[-1] not in kept]


NESTED_BLOCKSIZE = 256  # quantize_4bit(compress_statistics=True): quantize_blockwise(absmax - offset, blocksize=256)
DYNAMIC_CODE_BYTES = 256 * 4  # the 8-bit dynamic map (create_dynamic_map): 256 fp32 values


def storage_bytes(numel: int, double_quant: bool = False) -> int:
    """Bytes of one 4-bit weight: packed codes, its block scales, the 16-entry fp32 code table.
    Block scales: one fp32 absmax per block of 64; with double quantization (bitsandbytes 0.50
    `functional.quantize_4bit(compress_statistics=True)`) those absmax minus their mean are quantized again
    (`quantize_blockwise(..., blocksize=256)`): one uint8 per block of 64, one fp32 absmax per 256 of them, the
    0-dim fp32 `offset` (the mean) and `state2`'s own copy of the 256-entry fp32 dynamic code
    (`code.to(device, copy=True)`)."""
    blocks = -(-numel // BLOCKSIZE)
    if double_quant:
        scales = blocks + 4 * -(-blocks // NESTED_BLOCKSIZE) + 4 + DYNAMIC_CODE_BYTES
    else:
        scales = 4 * blocks
    return -(-numel // 2) + scales + CODE_BYTES


def int8_storage_bytes(numel: int, rows: int) -> int:
    """Bytes of one LLM.int8 weight (`Int8Params`): int8 `CB` (out, in), 1 byte per element, and fp32 `SCB`, one
    absmax per output row (`int8_vectorwise_quant` of the fp16 weight)."""
    return numel + FP32 * rows


def weight_storage_bytes(spec: ModelSpec, plan: TrainingPlan, p: ParamTensor) -> int:
    from llmem.components.lora import in_out

    if is_int8(plan):
        return int8_storage_bytes(p.numel, in_out(spec, p)[1])
    return storage_bytes(p.numel, plan.double_quant)


def process_map_bytes(plan: TrainingPlan) -> int:
    """bitsandbytes' own 256-entry fp32 dynamic map, made on the weights' device by the first double quantization
    of the process and kept for it (`functional.quantize_blockwise`: `name2qmap["dynamic"] =
    create_dynamic_map().to(A.device)`, bitsandbytes 0.50 functional.py:654), beside each weight's own copy."""
    return DYNAMIC_CODE_BYTES if plan.double_quant and not is_int8(plan) else 0


def base_parameter_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """The frozen base: quantized Linears plus everything else in the plan's parameter dtype, and the process's
    dynamic map (`process_map_bytes`)."""
    q = quantized_weights(spec, plan)
    plain = spec.total_params - sum(p.numel for p in q)
    return plain * plan.precision.param_bytes + sum(weight_storage_bytes(spec, plan, p) for p in q) + \
        process_map_bytes(plan)


@per_spec()
def dequant_forward_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Forward: the largest decoder-layer Linear's dequantized weight plus its output (tokens, out).
    `--quant int8` on the cuda profile runs no dequantization in the forward: `int8_forward_cuda_bytes` instead."""
    from llmem.components.lora import in_out

    if is_int8(plan) and plan.device is Device.CUDA:
        return int8_forward_cuda_bytes(spec, plan)
    if spec.derived is not None and not plan.checkpointed(spec.num_layers - 1):
        from llmem.components import act_offload

        if not act_offload.applies(plan):  # traced: the last layer's forward in flight holds each dequantized
            return 0  # weight where it is made (`walk.single.forward_inflight_bytes`, `llmem.derive.quant`)
    tokens = plan.batch_size * plan.seq_len
    cb = plan.precision.compute_bytes
    return max((p.numel * cb + tokens * in_out(spec, p)[1] * cb
                for p in quantized_weights(spec, plan) if p.layer == 0), default=0)


@per_spec()
def dequant_backward_extra_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Backward: how far a Linear's dequantized weight can lift the modelled layer-backward moment.

    That moment (`gradients.layer_backward_peak_extra_bytes`) is the sum of a Linear's input gradient from its
    base matmul and the one from its LoRA branch (tokens, in). Measured order in `MatMul4BitBackward`: weight
    dequantized, input gradient written, weight freed, then the sum allocated. So the dequantized moment exceeds
    the modelled one by numel * cb - tokens * in * cb when positive (wide weights, few tokens). Measured on
    llama/qwen3 (fp32, CPU) within 0.7 %; an approximation for the Linears before the MLP output."""
    from llmem.components.lora import in_out
    from llmem.components.quant_autocast import mlp_bytes

    if spec.derived is not None:  # traced (`llmem.derive.quant`): the layers' backward windows hold it already
        return 0
    tokens = plan.batch_size * plan.seq_len
    cb, gb = plan.precision.compute_bytes, mlp_bytes(plan)  # (gb: fp32 gradients under autocast)
    layer = [p for p in quantized_weights(spec, plan) if p.layer == 0]
    if not layer:
        return 0
    # the last Linear of the forward (the MLP output) runs its backward first, with all of the layer alive; the
    # others run after its input (tokens, in) that its LoRA branch kept has been freed
    last_in = in_out(spec, layer[-1])[0]
    best = max(0, layer[-1].numel * cb - tokens * last_in * gb)
    for p in layer[:-1]:
        best = max(best, p.numel * cb - tokens * (in_out(spec, p)[0] + last_in) * gb)
    return best


# --- 8-bit base (`--quant int8`, LLM.int8) -----------------------------------------------------------------------
# What runs (bitsandbytes 0.50.2): every Linear but the output layer is a `bnb.nn.Linear8bitLt(has_fp16_weights=False,
# threshold=6.0)` holding an `Int8Params` weight: `CB` int8 (out, in) and `SCB` fp32 (out,) (`int8_storage_bytes`).
# `Linear8bitLt.forward` calls `bnb.matmul(x, weight, state=self.state)` (autograd/_functions.py: `matmul`), which
# in training runs `MatMul8bitFp` when the input is on the CPU and `MatMul8bitLt` otherwise (CUDA):
#
# cpu profile, `MatMul8bitFp` (measured here):
#   forward: `CB = state.CB.data.to(A.dtype).mul_(state.SCB.unsqueeze(1).mul(1.0 / 127.0))`, the dequantized weight
#     (out, in) in the compute dtype, then `F.linear(A, CB)` writes the output (tokens, out): the moment of
#     `dequant_forward_bytes`, as for the 4-bit base (the scaled SCB, out * 4 bytes, is freed before the linear).
#   saved: `ctx.A = A`, the Linear's input, as a plain attribute of the autograd node (no `save_for_backward`).
#   backward: `CB = state.CB.to(ctx.dtype_A, copy=True).mul_(...)`, `grad_A = matmul(grad_output, CB)`: the dequantized
#     weight beside the input gradient, as in `MatMul4Bit`'s backward (`dequant_backward_extra_bytes`).
# cuda profile, `MatMul8bitLt` (from the source; not measurable here). Forward, for an input A (tokens T, in I) and
#   output width O, compute dtype of cb bytes; the weight needs no gradient, so the fast path:
#   1. `F.int8_vectorwise_quant(A.to(torch.float16), threshold=6.0)`: the fp16 copy of A (T*I*2, none when A is
#      fp16), freed when the call returns; inside (backends/cuda/ops.py `int8_vectorwise_quant`): `row_stats` SCA
#      fp32 (T*4) and `out_row` CA int8 (T*I) are allocated first, then `outliers = A.abs() >= threshold` makes the
#      fp16 `abs` (T*I*2, freed after the comparison) and the bool mask (T*I, a local until the call returns);
#      `outlier_cols` is `argwhere(...)` (int64, one per outlier column) or an empty tensor.
#   2. `int8_mixed_scaled_mm` (backends/default/ops.py, also on CUDA): with no outlier columns `subA =
#      torch.empty(0)`; `int8_scaled_mm` -> `int8_linear_matmul` (cuda: `torch.empty((T, O), dtype=int32)` written by
#      cublasLt igemmlt) -> `int8_mm_dequant` (cuda: `torch.empty_like(A_i32, dtype=float16)` then `.to(dtype)`, a copy
#      T*O*cb unless the compute dtype is fp16); the int32 product is freed when `int8_scaled_mm` returns.
#      With k outlier columns: `subA = A[:, cols].contiguous()` (T*k*cb), `subB` = the int8 columns copied (O*k),
#      dequantized to fp32 (O*k*4) and cast (O*k*cb), and `output.addmm(subA, subB)` a new output (T*O*cb).
#   saved: `ctx.tensors = (CAt=None, subA, A)` and `ctx.tensor_states = (SCAt=None, state.idx)`: attributes again,
#     so the input A (the 2-D view of the Linear's input, same storage) and subA are kept.
#   backward (`req_gradB` False): identical to the cpu profile's (`CB.to(dtype_A, copy=True).mul_`, `matmul`).
#   The two forward moments are `int8_forward_cuda_bytes`.
# Both profiles: ctx attributes are not saved tensors, so autograd does not release them after the node's backward,
# and activation checkpointing (saved-tensor hooks) does not drop them either: every 8-bit Linear whose input
# requires grad keeps that input alive until the graph is freed, i.e. until the step's outputs are dropped (after the
# optimizer step in this program). `held_input_bytes` lists them.


def int8_forward_cuda_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """cuda profile, one `MatMul8bitLt` forward: the larger of its two moments (see above) for the largest
    decoder-layer Linear, on top of the live activations (its input among them):
      quantization: fp16 copy of A (T*I*2 unless fp16) + CA (T*I) + SCA (T*4) + |A| fp16 (T*I*2) + mask (T*I);
      product: CA (T*I) + SCA (T*4) + int32 product (T*O*4) + fp16 dequantized (T*O*2) + output (T*O*cb unless fp16)."""
    from llmem.components.lora import in_out

    tokens = plan.batch_size * plan.seq_len
    cb = plan.precision.compute_bytes
    half_copy = 0 if plan.precision is Precision.FP16 else FP16
    out_copy = 0 if plan.precision is Precision.FP16 else cb
    best = 0
    for p in quantized_weights(spec, plan):
        if p.layer != 0:
            continue
        i, o = in_out(spec, p)
        quantize = tokens * i * (half_copy + 1 + FP16 + 1) + tokens * FP32
        product = tokens * i + tokens * FP32 + tokens * o * (INT32 + FP16 + out_copy)
        best = max(best, quantize, product)
    return best


def outlier_column_bytes(spec: ModelSpec, plan: TrainingPlan, columns: int) -> tuple[int, int]:
    """cuda profile, a bound for `columns` outlier columns in every 8-bit Linear (not in the estimate, which assumes
    OUTLIER_COLUMNS = 0): (bytes kept per decoder layer as `subA`, T*k*cb per Linear whose input requires grad; the
    largest extra forward transient: subB's int8, fp32 and cast copies plus the `addmm` output, O*k*(1+4+cb) +
    T*O*cb)."""
    from llmem.components.lora import in_out

    tokens = plan.batch_size * plan.seq_len
    cb = plan.precision.compute_bytes
    layer = [p for p in quantized_weights(spec, plan) if p.layer == 0]
    kept = len(layer) * tokens * columns * cb
    transient = max((in_out(spec, p)[1] * columns * (1 + FP32 + cb) + tokens * in_out(spec, p)[1] * cb
                     for p in layer), default=0)
    return kept, transient


# The Linears of a llama-like decoder layer that read the same input tensor, and its width
_INPUT_GROUPS = ((("q_proj", "k_proj", "v_proj"), "h"), (("o_proj",), "q"), (("gate_proj", "up_proj"), "h"),
                 (("down_proj",), "i"))


@per_spec()
def held_input_bytes(spec: ModelSpec, plan: TrainingPlan, first: bool = False,
                     checkpointed: bool | None = None) -> tuple[int, int]:
    """`--quant int8`: the inputs of one decoder layer's 8-bit Linears that their autograd nodes keep (`ctx.A` /
    `ctx.tensors`, above) until the outputs are dropped, as (all of them, the part LoRA's saved tensors do not
    already hold). One tensor per group of Linears reading the same input (q/k/v, o_proj, gate/up, down_proj), in the
    compute dtype. `MatMul8bitLt.forward` keeps them only when its input needs a gradient (`if
    any(ctx.needs_input_grad[:2])`, bitsandbytes/autograd/_functions.py:186; the weight is frozen): in layer 0 a group
    whose input does not (`lora_activations._requires_grad`: the frozen embeddings' output feeds q/k/v, and o_proj,
    gate/up, down_proj follow from the adapters before them) keeps none — unless --grad-ckpt full
    (`gradient_checkpointing_enable` calls `enable_input_require_grads()`) or a trainable embedding copy
    (`--lora-modules-to-save embed_tokens`) makes the embeddings' output require grad.
    Already held by LoRA (`lora.layer_saved`): o_proj's input where it is the fused sdpa output, which sdpa saves
    anyway (after eager attention it is a new contiguous tensor, `attn_output.transpose(1, 2).contiguous()`, that
    no op of the attention saves); the other inputs are lora_A's saved input only with dropout 0 in fp32 on an
    adapted group (with dropout lora_A saves the dropout output, in pure half precision its fp32 copy). With
    `--grad-ckpt full` LoRA's tensors are not saved in the forward, so all are extra there; with `--ckpt-every K`
    only in the checkpointed layers (`checkpointed`, default: every layer under --grad-ckpt full), while the input
    gradient hook is on for all of them."""
    from llmem.components.lora import _module, layer0_targeted, trains_copy
    from llmem.components.lora_activations import _flash_output_is_o_input, _requires_grad

    if not is_int8(plan) or spec.derived is not None:  # traced: in the layer tables (`quant_int8_traced`)
        return 0, 0
    tokens = plan.batch_size * plan.seq_len
    cb = plan.precision.compute_bytes
    widths = {"h": spec.hidden_size, "q": spec.num_heads * spec.head_dim, "i": spec.intermediate_size}
    adapted = {_module(p).rsplit(".", 1)[-1] for p in layer0_targeted(spec, plan)}
    lora_keeps_x = plan.lora_dropout == 0 and plan.precision is Precision.FP32
    ckpt_on = plan.grad_ckpt is GradCkpt.FULL
    ckpt = ckpt_on if checkpointed is None else checkpointed
    g = _requires_grad(adapted, first and not (ckpt_on or trains_copy(spec, plan, "embed")))
    input_grad = (g["input"], g["attention"], g["residual"], g["down_proj input"])
    o_input_saved = _flash_output_is_o_input(spec, plan)
    held = extra = 0
    for k, (names, width) in enumerate(_INPUT_GROUPS):
        if not input_grad[k]:
            continue
        size = tokens * widths[width] * cb
        held += size
        if ckpt:
            extra += size
        elif not (names == ("o_proj",) and o_input_saved) and not (lora_keeps_x and adapted & set(names)):
            extra += size
    return held, extra


def bits(plan: TrainingPlan) -> str:
    return "8-bit" if is_int8(plan) else "4-bit"


def forward_moment_label(plan: TrainingPlan) -> str:
    if is_int8(plan) and plan.device is Device.CUDA:
        return "8-bit matmul (int8 input, int32 product)"
    return f"{bits(plan)} weight dequantized"


@per_spec()
def held_past_adapter_bytes(spec: ModelSpec, plan: TrainingPlan, checkpointed: bool | None = None) -> int:
    """`--quant int8`, beyond LoRA's walk at a decoder layer's backward moment (the MLP's down_proj input gradient,
    base + adapter, being summed; `gradients.layer_backward_peak_extra_bytes`), measured on CPU (llama, qwen3):
    - without checkpointing, when lora_A keeps down_proj's input itself (dropout 0, fp32, down_proj adapted), LoRA's
      walk has it freed by lora_A's backward there; the 8-bit node still holds it (T*i*cb);
    - with --grad-ckpt full, when lora_A does not keep the q/k/v input itself (dropout > 0 or half precision), the
      recomputed input_layernorm output (T*h*cb) is still alive there (LoRA's walk frees it after the recompute):
      the recomputed 8-bit q/k/v nodes hold it as `ctx.A`. (The forward's own inputs are in `held_input_bytes`.)
    `checkpointed`: whether the layer in backward is (default: every layer under --grad-ckpt full)."""
    from llmem.components.lora import _module, layer0_targeted

    if not is_int8(plan) or spec.derived is not None:  # traced: the backward windows hold them
        return 0
    adapted = {_module(p).rsplit(".", 1)[-1] for p in layer0_targeted(spec, plan)}
    lora_keeps_x = plan.lora_dropout == 0 and plan.precision is Precision.FP32
    tokens, cb = plan.batch_size * plan.seq_len, plan.precision.compute_bytes
    if plan.grad_ckpt is GradCkpt.FULL if checkpointed is None else checkpointed:
        return 0 if lora_keeps_x and adapted & {"q_proj", "k_proj", "v_proj"} else tokens * spec.hidden_size * cb
    return tokens * spec.intermediate_size * cb if lora_keeps_x and "down_proj" in adapted else 0


# --- FSDP2 (`--zero 2/3`, `--tp 1`) over the 4-bit base ------------------------------------------------------------
# What runs (torch 2.13 `fully_shard` per decoder layer + root, pure precision, no MixedPrecisionPolicy; bitsandbytes
# 0.50.2): `FSDPParam._init_sharded_param` takes each `Params4bit` as a plain tensor, its packed codes of shape
# (ceil(numel / 2), 1) uint8, chunks it on dim 0 and pads every rank's chunk to the first's,
# ceil(ceil(numel / 2) / dp) bytes (`param_data.new_zeros(padded_sharded_size)`), and registers a uint8 DTensor
# in its place; the `quant_state` (fp32 absmax, 16-entry code table) is no parameter: the `Linear4bit` module keeps it
# (`module.quant_state`, set by `Params4bit._quantize`), whole on every rank.
# All-gather (`_fsdp_collectives.foreach_all_gather`): a decoder layer's group holds its packed codes (uint8), its
# norm weights (the plan's dtype) and its fp32 adapters; their dtypes differ, so `_get_all_gather_input_metadatas`
# gathers them as bytes (uint8 views): input = the sum of the padded shards' bytes, output = dp times that. The
# copy-out gives each unsharded parameter its (padded) storage, the codes back as a (ceil(numel / 2), 1) uint8
# tensor; `Linear4bit.forward` then finds a weight without `quant_state` and wraps it
# (`fix_4bit_weight_quant_state_from_module`: `Params4bit(weight, ...)`, the same storage, nothing allocated) with
# the module's `quant_state`, so the dequantized-weight moments are the single-GPU ones (`dequant_forward_bytes`,
# `dequant_backward_extra_bytes`). The codes have no gradient: `foreach_reduce` reduce-scatters the adapters only;
# the optimizer steps the adapters' fp32 shards.


def fsdp_layer_base_bytes(spec: ModelSpec, plan: TrainingPlan, layer: int, gathered: bool = False) -> int:
    """FSDP2: one rank's padded shard of decoder layer `layer`'s frozen base (`gathered`: the all-gather output's
    share of it, dp shards): the packed codes, 1 byte per row of (ceil(numel / 2), 1), and the other tensors (norm
    weights, biases) in the plan's dtype; gathered under --precision bf16-/fp16-mixed, in the MixedPrecisionPolicy's
    param_dtype (torch 2.13 `_fully_shard/_fsdp_param.py:597`, `init_dtype_attrs`: no param_dtype for a parameter not
    floating point; line 901, `all_gather_inputs`: the shard cast to it; so the uint8 codes are gathered as stored)."""
    from llmem.components.sharding import fsdp_shard_numel

    quantized = {p.name for p in quantized_weights(spec, plan)}
    mixed_gather = gathered and plan.precision.is_mixed
    pb = plan.precision.compute_bytes if mixed_gather else plan.precision.param_bytes
    total = 0
    for p in spec.layer_params(layer):
        if p.name in quantized:
            total += fsdp_shard_numel((-(-p.numel // 2), 1), plan)
        else:
            total += fsdp_shard_numel(p.shape, plan) * pb
    return total * (plan.dp if gathered else 1)


def quant_state_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Each 4-bit weight's `quant_state` (fp32 absmax per block of 64, the 64-byte code table), not sharded, and the
    process's dynamic map (`process_map_bytes`)."""
    return sum(storage_bytes(p.numel, plan.double_quant) - -(-p.numel // 2)
               for p in quantized_weights(spec, plan)) + process_map_bytes(plan)


def fsdp_base_parameter_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """FSDP2: the frozen base on one rank: every decoder layer's padded shard (`fsdp_layer_base_bytes`), the root's
    (embeddings, final norm, lm_head: the plan's dtype) and the whole quant_states."""
    from llmem.components.sharding import local_numel

    root = sum(local_numel(p, plan) for p in spec.outer_params) * plan.precision.param_bytes
    layers = sum(fsdp_layer_base_bytes(spec, plan, k) for k in range(spec.num_layers))
    return root + layers + quant_state_bytes(spec, plan)
