"""`--cp N`: what context parallelism adds to a rank's memory beyond FSDP2 on its sequence shard.

A rank of a cp group runs the plan's program on seq_len / cp tokens (the local plan, `local_plan`: every activation,
the logits and the loss at seq_len / cp; FSDP2 shards parameters, gradients and states over all GPUs, torchtitan's
and accelerate's dp_shard × cp mesh). On top of it (torch 2.13 `torch/distributed/tensor/experimental/
_context_parallel/_attention.py`, transformers 5.23, accelerate 1.15), each term below, for the worst rank: every rank
but the last of its group (the last one's shards are adjacent and it never merges a partial block).
"""

from __future__ import annotations

from llmem.components.activations import _bytes
from llmem.spec import ModelSpec

INT64 = 8
FP32 = 4
BUFFERS = 4  # input_ids, labels, shift_labels, position_ids (transformers `trainer.py:2393-2487`)


def local_plan(plan):
    """The plan a rank runs on its shard: the same plan on seq_len / cp tokens, without cp."""
    return plan.with_(cp=1, seq_len=plan.seq_len // plan.cp)


def _local(plan) -> int:
    return plan.seq_len // plan.cp


def step_buffers_bytes(plan) -> int:
    """The step's buffers while the step runs and after it, until the next step's: input_ids, labels, shift_labels
    (int64, batch × seq) and position_ids, which `context_parallel` resizes in place to their shard
    (`_attention.py:1599-1601`, `buffer.resize_`: a smaller shape keeps the storage, so each keeps its full
    batch × seq bytes; position_ids is an expanded arange of seq, unless the shard needs more), plus the rank's own
    copy of the whole batch's input_ids beyond the local plan's (the session's, batch × seq)."""
    b, s, sl = plan.batch_size, plan.seq_len, _local(plan)
    return (3 * b * s + max(s, b * sl)) * INT64 + b * (s - sl) * INT64


def context_held_bytes(plan) -> int:
    """Inside the context (forward and backward): `context_parallel`'s generator frame keeps `shards` (each buffer's
    contiguous local shard from `distribute_tensor(...).to_local()`, `_attention.py:1163-1165`) and the last
    `shard.clone()` (`_attention.py:1599`): five int64 shards of batch × seq / cp."""
    return (BUFFERS + 1) * plan.batch_size * _local(plan) * INT64


def rope_batch_bytes(spec: ModelSpec, plan) -> int:
    """RoPE's cos and sin for position_ids of the whole micro-batch (batch × seq / cp × rotary dim, in the hidden
    states' dtype) instead of the local plan's batch-1 position ids (`activations.outer_saved`): (batch − 1) more
    rows of each. A traced architecture: its batch-free saved tensors before the layers (`derive.context_parallel.
    batch_free_outer_bytes`: cos and sin at one row, of the rotary dim of a partial rotary) on the local plan."""
    if spec.derived is not None:
        from llmem.derive.context_parallel import batch_free_outer_bytes

        return (plan.batch_size - 1) * batch_free_outer_bytes(spec, local_plan(plan))
    if not spec.family.rope:
        return 0
    _, rb = _bytes(plan)
    return 2 * (plan.batch_size - 1) * _local(plan) * spec.head_dim * rb


def rope_layer_batch_bytes(spec: ModelSpec, plan, layer: int) -> int:
    """A traced decoder layer's own saved tensors made from the position tables (`derive.context_parallel.
    batch_free_layer_bytes`, e.g. glm4's interleaved cos and sin) at the whole micro-batch: (batch − 1) more rows,
    alive while the layer's saved tensors are (`walk.context_parallel._saving_layers`). 0 for the hand-written
    tables (their RoPE is `rope_batch_bytes`)."""
    if spec.derived is None or plan.batch_size == 1:
        return 0
    from llmem.derive.context_parallel import batch_free_layer_bytes

    return (plan.batch_size - 1) * batch_free_layer_bytes(spec, local_plan(plan), layer)


def packed_mask_bytes(plan) -> int:
    """During the forward, on every rank but the last: the load-balanced position ids jump (chunks r and 2cp-1-r),
    so transformers' mask builder takes them for packed sequences (`masking_utils.py:750-779`,
    `find_packed_sequence_indices`) and builds a boolean (batch, 1, seq/cp, seq/cp) mask that accelerate's self_attn
    hook then drops (`big_modeling.py:828`); freed when the decoder stack returns."""
    sl = _local(plan)
    return plan.batch_size * sl * sl


def attention_copy_bytes(spec: ModelSpec, plan) -> int:
    """Per decoder layer, saved until o_proj's backward, on every rank but the last: the merged attention output of
    a rank that merged a partial block is `torch.cat`'s contiguous (batch, heads, seq, head_dim) tensor
    (`_partial_update`, `_attention.py:113-136`), so transformers' `attn_output.transpose(1, 2).contiguous()`
    (`integrations/sdpa_attention.py`) copies it for o_proj, which keeps the copy when autograd saves its input
    (`o_proj_saves_input`); without cp (and on the last rank) the kernel's output is laid out (batch, seq, heads,
    head_dim) and the same call returns it as is. A traced layer whose table already holds that copy (q made
    contiguous by a partial rotary's cat, `derive.context_parallel.copies_attention_output`) adds none."""
    if not o_proj_saves_input(spec, plan):
        return 0
    if spec.derived is not None:
        from llmem.derive.context_parallel import copies_attention_output

        if copies_attention_output(spec, local_plan(plan)):
            return 0
    cb, _ = _bytes(plan)
    return plan.batch_size * _local(plan) * spec.num_heads * spec.head_dim * cb


def o_proj_saves_input(spec: ModelSpec, plan) -> bool:
    """Whether autograd keeps o_proj's input: its weight's gradient needs it in full fine-tuning; under LoRA the base
    weight is frozen and only the adapter's `lora_A` saves its input, which is o_proj's input itself when o_proj is
    targeted and `--lora-dropout` is 0 (PEFT 0.21 `lora/layer.py`, `Linear.forward`: `lora_A(dropout(x))`; with
    p > 0 the dropout's output is saved instead, and the copy is freed after the forward)."""
    from llmem.choices import Method
    from llmem.components import lora

    if plan.method is Method.FULL:
        return True
    targets = lora.layer0_targeted(spec, plan)
    return plan.lora_dropout == 0 and any(p.name.endswith("self_attn.o_proj.weight") for p in targets)


def ring_backward_bytes(spec: ModelSpec, plan, last: bool = False) -> int:
    """The ring's backward (`_templated_ring_attention_backward`, `_attention.py:488-655`) at its largest instant, the
    second block's kernel call, beyond the local plan's sdpa backward (whose kernel outputs, q's, k's and v's
    gradients, are the first block's here): fp32 accumulators of q's, k's and v's gradients (`zeros_like(...,
    dtype=float32)`, `_cp_options.convert_to_f32`); the flattened k and v sent round the ring (`torch.cat`, held to
    the end) and the group's all-gathered copy of them (`_AllGatherRotater`: cp × the rank's k and v; the
    `key.contiguous()` / `value.contiguous()` copies are released as the first received block replaces them); the
    flattened fp32 k and v gradients sent to the next rank and the buffer received (`_AllToAllRotater`,
    `permute_tensor`); and the second call's gradients while the first's are held. The load-balanced second block
    (`_attention.py:566-593`) is a full q with half the keys and values on a rank past its first step (every rank
    but rank 0; with `last`, the last rank), and half of q with all the keys and values on rank 0, the worst rank of
    a 2-rank group otherwise, with its logsumexp's half copied."""
    cb, _ = _bytes(plan)
    tokens = plan.batch_size * _local(plan)
    q, kv = tokens * spec.num_heads * spec.head_dim, tokens * spec.num_kv_heads * spec.head_dim
    accumulators = (q + 2 * kv) * FP32
    sent = 2 * kv * cb
    gathered = plan.cp * 2 * kv * cb
    exchanged = 2 * (2 * kv * FP32)
    if last or plan.cp > 2:
        second = (q + kv) * cb
    else:  # rank 0's partial step: half of q, and its logsumexp half made contiguous (`_attention.py:590-592`)
        second = (q // 2 + 2 * kv) * cb + tokens // 2 * spec.num_heads * FP32
    return accumulators + sent + gathered + exchanged + second


def sliding_layers(spec: ModelSpec) -> bool:
    """Whether some layer attends in a window: what accelerate's `_attach_context_parallel_hooks` refuses
    (`big_modeling.py:807-826`: any `config.layer_types` entry other than "full_attention", or, for a config
    without layer_types, a `sliding_window`), read from the config as transformers 5.23 completes it: mistral's
    `sliding_window` defaults to 4096 (`configuration_mistral.py:80`); qwen2/qwen3 make layers ≥ max_window_layers
    sliding when `use_sliding_window` (`configuration_qwen2.py:84-93`), qwen2_moe the even ones below it
    (`configuration_qwen2_moe.py:113-119`): `Family.window_layers`."""
    cfg = getattr(spec, "source_config", None) or {}
    if cfg.get("layer_types"):
        return any(t != "full_attention" for t in cfg["layer_types"])
    rule = spec.family.window_layers  # how the config class makes layers sliding (`Family.window_layers`)
    if rule:
        window_layers = int(cfg.get("max_window_layers", 28))
        if not cfg.get("use_sliding_window"):
            return False
        if rule == "even-below-max":
            return window_layers > 0
        return cfg.get("sliding_window", 4096) is not None and window_layers < spec.num_layers
    return bool(cfg.get("sliding_window", spec.family.sliding_window_default))  # the config class's default


# Traced architectures measured under --cp (docs/notes/2026-11-28-traced-context-parallel.md): dense, sdpa, a
# `self_attn` module, full fine-tuning
TRACED_MEASURED = ("olmo2", "granite", "smollm3", "stablelm", "phi", "cohere", "glm4", "starcoder2")


def check(spec: ModelSpec, plan) -> None:
    """The model's side of `--cp`: measured on the hand-written families with SDPA attention and a `self_attn`
    module for accelerate's mask hook (llama, mistral, qwen2, qwen3, gemma, mixtral, qwen2_moe) and on the traced
    dense architectures of `TRACED_MEASURED` in full fine-tuning (`check_traced`); sliding-window layers are refused
    as accelerate refuses them (`sliding_layers`). Others are a gap: phi3 (fused qkv) estimated 1.5 % low, opt 4.7 %
    low; docs/notes/2026-11-27-context-parallel.md."""
    from llmem.errors import GAP, REFUSED, InputError
    from llmem.families import has_trait, with_trait

    if plan.cp <= 1:
        return
    if not any(".self_attn." in p.name for p in spec.layer_params(0)):
        raise InputError("cp", f"accelerate's context-parallel hook drops the attention mask of `self_attn` modules "
                         f"only (`big_modeling.py:840-848`); {spec.model_type!r} has none, so the load-balanced "
                         "shard's packed-sequence mask reaches the ring, which refuses a mask (torch "
                         "`_attention.py:700`): use --cp 1", REFUSED)
    if spec.derived is not None:
        check_traced(spec, plan)
    elif not has_trait(spec.model_type, "context_parallel"):
        raise InputError("cp", "context parallelism is modelled and measured for "
                         f"{', '.join(with_trait('context_parallel') + TRACED_MEASURED)}; "
                         f"{spec.model_type!r} is not modelled yet: use --cp 1", GAP)
    if sliding_layers(spec):
        raise InputError("cp", "context parallelism runs full causal attention (accelerate drops the mask and "
                         f"refuses sliding-window layers); this {spec.model_type} config has sliding-window "
                         "layers: set sliding_window to null (use_sliding_window false), or use --cp 1", REFUSED)


def check_traced(spec: ModelSpec, plan) -> None:
    """A traced architecture under `--cp` (with a `self_attn` module, `check`). Modelled: the architectures measured
    (`TRACED_MEASURED`), dense, in full fine-tuning — the walk's traced sdpa-backward moment
    (`walk.fsdp_layer._traced_sdpa_moment`) carries the ring; traced LoRA and MoE are not measured (gap)."""
    from llmem.choices import Method
    from llmem.errors import GAP, InputError

    if spec.model_type not in TRACED_MEASURED or spec.is_moe or plan.method is not Method.FULL:
        raise InputError("cp", "context parallelism on a traced architecture is measured for "
                         f"{', '.join(TRACED_MEASURED)} (dense) in full fine-tuning; {spec.model_type!r} with --method "
                         f"{plan.method.value} is not modelled yet: use --cp 1 or --method full", GAP)
