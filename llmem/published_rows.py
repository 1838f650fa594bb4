"""The rows of `tests/data/published_measurements.csv` that `llmem.published` compares, and why.

`CLAIMS`: rows whose program is ours up to the differences each states, compared with the matching figure of the
estimate. `REFERENCE`: rows close to our program but not it, estimated and shown without counting. `NOT_CLAIMED`:
rows looked at and left out, with the reason (the rules in `llmem.published.unclaimed_reason` cover the rest).
Pure data: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ALLOCATED, RESERVED, DEVICE = "allocated", "reserved", "device"


@dataclass(frozen=True)
class Claim:
    """How a row maps to this estimator: the preset, the plan settings the CSV columns do not pin down, the
    statistic the source measured and why the row matches our program (and where it knowingly differs). `config`:
    fields of the preset's config.json replaced where the source's own model code computes a layer differently
    (never a shape: the tests check the parameter count is the preset's)."""

    preset: str
    statistic: str
    why: str
    plan: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)


_LORA_QV = "q_proj,v_proj"
CLAIMS: dict[str, Claim] = {
    "peft_method_comparison_001": Claim(
        "llama-3.2-3b", RESERVED,
        "HF Llama-3.2-3B in a plain PyTorch loop (model(**batch) with labels, backward, AdamW step), bf16 weights "
        "without AMP = our pure bf16, torch AdamW (foreach on CUDA), sdpa, micro-batch 4. Its statistic samples "
        "memory_reserved() after each step (the allocator keeps the step's peak reservation; empty_cache every 10 "
        "steps), 99th percentile: compared with reserved_bytes. Batches are length-bucketed and padded to their "
        "longest sample, truncated at 768: seq 768 is the upper end. Differs: clip_grad_norm_ (small foreach norms).",
        dict(precision="bf16", seq_len=768)),
    "peft_method_comparison_002": Claim(
        "llama-3.2-3b", RESERVED,
        "As peft_method_comparison_001 with PEFT LoRA: the experiment's adapter_config is r 32, alpha 64, dropout "
        "0.0, target_modules null (PEFT's llama default q_proj,v_proj), adapters autocast to fp32 = our --method "
        "lora under pure bf16. Same statistic and the same seq-768 upper end.",
        dict(precision="bf16", seq_len=768, lora_alpha=64, lora_dropout=0.0, lora_targets=_LORA_QV)),
    "litgpt_resource_tables_014": Claim(
        "llama-2-7b", ALLOCATED,
        "Llama-2-7B LoRA r8 alpha16 on q,v with LitGPT's finetune/lora.py (dropout 0.05), bf16-true = pure bf16, "
        "torch AdamW, micro-batch 2 padded to the longest Alpaca sample (1304 tokens, iteration 0), "
        "max_memory_allocated. Differs: LitGPT's own Llama code (fused qkv Linear, chunked lm_head and loss, bf16 "
        "adapters) - the same tensors up to the loss, whose logits LitGPT keeps in bf16 chunks.",
        dict(precision="bf16", lora_alpha=16, lora_dropout=0.05, lora_targets=_LORA_QV)),
    "litgpt_resource_tables_016": Claim(
        "llama-2-13b", ALLOCATED,
        "Llama-2-13B QLoRA: bitsandbytes nf4 base (no double quantization), LoRA r8 alpha16 on q,v (dropout "
        "0.05), bf16-true, micro-batch 1 x 1304 tokens, max_memory_allocated = our --method qlora --quant nf4 "
        "--precision bf16. Differs: LitGPT's model code (see litgpt_resource_tables_014); PagedAdamW keeps its "
        "(tiny) states in paged memory outside the allocator; and the bitsandbytes of 2023 saved every 4-bit "
        "Linear's input for backward (MatMul4Bit ctx.tensors = (A, B)), which bitsandbytes 0.50 no longer does.",
        dict(precision="bf16", quant="nf4", lora_alpha=16, lora_dropout=0.05, lora_targets=_LORA_QV)),
    "litgpt_config_hub_021": Claim(
        "mistral-7b-v0.3", ALLOCATED,
        "Mistral-7B QLoRA: bitsandbytes nf4, LoRA r32 alpha16 on q,v (dropout 0.05), bf16-true, micro-batch 2 "
        "padded to the longest Alpaca2k sample (max_seq_length 512: seq 512 is the upper end), no checkpointing, "
        "max_memory_allocated. Differs: v0.2 has a 32000-token vocabulary (the v0.3 preset 32768: +6 M parameters); "
        "LitGPT model code, PagedAdamW and the older bitsandbytes as in litgpt_resource_tables_016.",
        dict(precision="bf16", quant="nf4", seq_len=512, lora_alpha=16, lora_dropout=0.05, lora_targets=_LORA_QV)),
    "torchtune_docs_003": Claim(
        "llama-2-7b", RESERVED,
        "Llama-2-7B LoRA r64 alpha128 on q,v with torchtune's lora_finetune_single_device, pure bf16, torch AdamW, "
        "micro-batch 2 padded to the longest Alpaca sample (max 512: the upper end), activation checkpointing per "
        "layer (as our --grad-ckpt full), peak reserved memory; LoRA dropout 0.05 (the builder's default in "
        "torchtune of April 2024). Differs: torchtune's own Llama code (bf16 adapters).",
        dict(precision="bf16", seq_len=512, grad_ckpt="full", lora_alpha=128, lora_dropout=0.05,
             lora_targets=_LORA_QV)),
    "torchtune_readme_030": Claim(
        "llama-2-7b", RESERVED,
        "Llama-2-7B full fine-tune with torchtune's full_finetune_distributed (7B_full) on 4 GPUs: FSDP1 "
        "(FullyShardedDataParallel) FULL_SHARD, one unit per decoder layer and the root = our --engine fsdp1 --zero 3 "
        "on 4 GPUs, pure bf16 (bf16 AdamW states, no MixedPrecision), torch AdamW, micro-batch 2 padded to the "
        "longest Alpaca sample (max 512: the upper end), activation checkpointing per layer (--grad-ckpt full). "
        "Statistic not named by the README: reserved_bytes, as torchtune_readme_027. Read at the README's commit "
        "(fef3ed10) and torch 2.2.2, the recipe's peak is ours term by term: the optimizer step, foreach AdamW "
        "(FlatParameter is a plain nn.Parameter) over the flat shards: weights, gradients, both bf16 states and "
        "_foreach_sqrt's one copy, 16.91 GB allocated. Differs: torchtune's FSDP1 wrapping (rank 0 builds on the "
        "CPU, the others on the meta device, sync_module_states; the cache emptied before training), its own Llama "
        "code (fp32 logits, only around the loss). The point figure is that program's reserved memory: FSDP1's "
        "requests replayed through the caching-allocator model with the cache emptied after wrapping, each on its "
        "stream, so the unshard-stream pool (the root and two layers, 1.33 GB) and the post-backward pool stay "
        "apart from the default stream's blocks (19.97 GB; the note's floor was 18.25). The figure, 'averaged over "
        "multiple runs' with its statistic unnamed, lies 2.9 GB above it and 2.7-6.0 GB above every other reading "
        "of this program (allocated, nvidia-smi); the same table holds figures taken on other code and in other "
        "ways (docs/notes/2026-11-28-torchtune-fsdp1-rows.md, docs/notes/2026-11-28-fsdp1-reserved.md).",
        dict(precision="bf16", zero=3, seq_len=512, engine="fsdp1")),
    "litgpt_config_hub_024": Claim(
        "phi-2", ALLOCATED,
        "Phi-2 full fine-tune with LitGPT's finetune_full on 2 GPUs (the config's devices: 2; the table names a "
        "4xA10G machine, but on 4 this estimate reads about half the measured peak): Lightning Fabric's "
        "FSDPStrategy is FSDP1 FULL_SHARD wrapping each Block, bf16-true (bf16 "
        "weights, gradients and AdamW states) = our --engine fsdp1 --zero 3 --precision bf16, torch AdamW, "
        "micro-batch 4 padded to the longest Alpaca2k sample (max_seq_length 512: the upper end), activation "
        "checkpointing per Block (--grad-ckpt full), max_memory_allocated. LitGPT's Phi computes its tanh GELU "
        "as one op (gelu_approximate tanh): config hidden_act gelu_pytorch_tanh, the same op (the hub's gelu_new "
        "composes it of saved elementwise tensors; checkpointed, the estimate is the same either way). Differs: "
        "LitGPT's own Phi code (fused qkv, its chunked loss).",
        dict(precision="bf16", zero=3, seq_len=512, engine="fsdp1"), dict(hidden_act="gelu_pytorch_tanh")),
    "litgpt_resource_tables_001": Claim(
        "phi-1.5", ALLOCATED,
        "Phi-1.5 LoRA r8 alpha16 on q,v (trainable 1,572,864, as ours on q_proj,v_proj) with LitGPT's "
        "finetune/lora.py of October 2023 (dropout 0.05), bf16-true = pure bf16, torch AdamW, micro-batch 1 x 1044 "
        "tokens (the longest Alpaca sample, iteration 0), no checkpointing, max_memory_allocated. LitGPT's Phi "
        "computes its tanh GELU as one fused op (gelu_approximate tanh), so the config's hidden_act is "
        "gelu_pytorch_tanh (that op): transformers' gelu_new composes it of elementwise ops that keep about "
        "three more T x 8192 tensors per layer, and with it this estimate reads about 29 % higher. Differs: "
        "LitGPT's own Phi code (fused qkv with one lora_A for q and v, bf16 adapters, its chunked loss).",
        dict(precision="bf16", lora_alpha=16, lora_dropout=0.05, lora_targets=_LORA_QV),
        dict(hidden_act="gelu_pytorch_tanh")),
    "litgpt_resource_tables_005": Claim(
        "phi-1.5", ALLOCATED,
        "As litgpt_resource_tables_001 at micro-batch 4 x 1044 tokens. With transformers' composed gelu_new "
        "this estimate reads about 52 % higher.",
        dict(precision="bf16", lora_alpha=16, lora_dropout=0.05, lora_targets=_LORA_QV),
        dict(hidden_act="gelu_pytorch_tanh")),
    "litgpt_resource_tables_009": Claim(
        "stablelm-base-alpha-3b", ALLOCATED,
        "StableLM-Base-Alpha-3B LoRA r8 alpha16 on q and v with LitGPT's finetune/lora.py of October 2023 (dropout "
        "0.05), bf16-true = pure bf16, torch AdamW, micro-batch 2 x 1034 tokens (the longest Alpaca sample), no "
        "checkpointing, max_memory_allocated; GELU exact in both codes. Ours adapts the fused query_key_value "
        "Linear (transformers' GPT-NeoX layout): the same trainable count (2,097,152: per layer r x 4096 + "
        "12288 x r = LitGPT's 2r x 4096 + 8192 x 2r) and one input copy per layer, but its lora_B output is "
        "12288 wide where LitGPT's is 8192 (zero-padded into q,k,v after). Differs: LitGPT's own GPT-NeoX code "
        "(bf16 adapters, its chunked loss).",
        dict(precision="bf16", lora_alpha=16, lora_dropout=0.05, lora_targets="query_key_value")),
    "torchtitan_001": Claim(
        "llama-3.1-8b", RESERVED,
        "Llama 3.1 8B pre-training with torchtitan (December 2024) on 8 H100s (96 GB), its Table 1 row without "
        "torch.compile or Float8: FSDP2 fully_shard per TransformerBlock and the root, MixedPrecisionPolicy(param "
        "bf16, reduce fp32) over fp32 weights = our --zero 3 --precision bf16-mixed on 8 GPUs, torch AdamW (foreach, "
        "fp32 states), local batch 2 x 8192 tokens of C4 (no padding), torchtitan's op-level selective activation "
        "checkpointing (--grad-ckpt selective: the same save list of mm, flash/efficient attention, reduce_scatter "
        "and max), torch.cuda max_memory_reserved (the largest over the ranks) in "
        "GiB (converted to GB). A full training step: pre-training and fine-tuning hold the same memory. Differs: "
        "torchtitan's own Llama code (complex-number RoPE; the output cast to fp32 in the model and deleted by the "
        "loop before backward, del pred, where transformers' logits live through it), its last block not "
        "resharded after forward (one bf16 layer gathered through to backward), clip_grad_norm_ (foreach norms).",
        dict(method="full", zero=3, precision="bf16-mixed", grad_ckpt="selective")),
}

# Close to our program but not it: LoRA and QLoRA runs under FSDP1 (FullyShardedDataParallel: flat parameters per
# wrapped unit). The LoRA rows are estimated as --engine fsdp1 --fsdp1-wrap adapters with bf16 adapters, the
# QLoRA rows likewise (--method qlora); shown for reference in docs/PUBLISHED.md, they do not
# count toward the bound: each still differs as it states.

# Answer.AI's QLoRA rows: their program (train.py at 049515f)
_ANSWERAI_QLORA_WRAP = (
    "reserved memory. train.py runs FSDP1 over bf16-stored codes (bnb_4bit_quant_storage=bf16) with the adapters "
    "cast to bf16 and wraps it by get_wrapping_policy (each trainable adapter Linear its own unit, "
    "use_orig_params=False: the decoder layers' units over the codes are frozen): estimated as our --engine fsdp1 "
    "--fsdp1-wrap adapters --lora-adapter-dtype base. Differs: reentrant checkpointing and March 2024 transformers "
    "(fp32 logits upcast inside the model).")

REFERENCE: dict[str, Claim] = {
    "torchtune_readme_027": Claim(
        "llama-2-7b", RESERVED,
        "Llama-2-7B LoRA r8 alpha16 on q,v (torchtune's 7B_lora config: no MLP or output adapters, activation "
        "checkpointing off) with lora_finetune_distributed on 2 GPUs, FULL_SHARD = our --zero 3 on 2 GPUs, pure "
        "bf16, torch AdamW, micro-batch 2 padded to the longest Alpaca sample (max 512: the upper end); LoRA "
        "dropout 0.05 (the builder's default then). The README does not name the statistic: compared with "
        "reserved_bytes, as the torchtune tutorial of the same month (torchtune_docs_003) reports reserved memory. "
        "torchtune of April 2024 sharded with FSDP1 and built its adapters in the model's bf16, wrapped as "
        "lora_fsdp_wrap_policy does (every lora_a and lora_b a unit of its own, use_orig_params=False: each "
        "layer's FlatParameter holds the frozen base only and requires no grad): estimated as our --engine fsdp1 "
        "--fsdp1-wrap adapters with --lora-adapter-dtype base. Differs: torchtune's own Llama code and LoRA "
        "modules (torchtune's LoRALinear, not PEFT's; fp32 logits at the loss, about 0.3-0.4 GB more there). The "
        "program holds about 13.1-13.5 GB allocated, which this estimate now reproduces; the figure, an average "
        "over several runs, lies 7-7.5 GB above it (docs/notes/2026-11-28-torchtune-fsdp1-rows.md, "
        "docs/notes/2026-11-28-fsdp1-adapters-wrap.md).",
        dict(precision="bf16", zero=3, seq_len=512, lora_alpha=16, lora_dropout=0.05, lora_targets=_LORA_QV,
             engine="fsdp1", lora_adapter_dtype="base", fsdp1_wrap="adapters")),
    "answerai_fsdp_qlora_008": Claim(
        "llama-2-7b", RESERVED,
        "Llama-2-7B LoRA (train_type lora: PEFT) with Answer.AI's train.py on 2 GPUs, FSDP FULL_SHARD = our --zero 3 "
        "on 2 GPUs, pure bf16 (no MixedPrecision policy), torch AdamW on the adapters, LoRA r64 alpha16 dropout 0.1 "
        "on q,k,v,gate,up,down (lora_target_modules all: no o_proj), micro-batch 6 of a dummy dataset at exactly "
        "2048 tokens, activation checkpointing per decoder layer, peak reserved memory (reported in GiB, converted "
        "to GB). FSDP1 with the model, adapters included, cast to bf16 before wrapping, wrapped by "
        "get_wrapping_policy (each trainable adapter Linear its own unit, use_orig_params=False): estimated as our "
        "--engine fsdp1 --fsdp1-wrap adapters with --lora-adapter-dtype base. Differs: reentrant checkpointing; "
        "and transformers of March 2024 upcast the "
        "whole logits to fp32 inside the model (logits.float()) and shifted them with .contiguous() copies before "
        "the loss, where today's transformers upcasts inside the loss only - about 1.6 GB of extra fp32 logits at "
        "6 x 2048 x 32000.",
        dict(precision="bf16", zero=3, seq_len=2048, grad_ckpt="full", lora_alpha=16, lora_dropout=0.1,
             lora_targets="q_proj,k_proj,v_proj,gate_proj,up_proj,down_proj", engine="fsdp1",
             lora_adapter_dtype="base", fsdp1_wrap="adapters")),
    "answerai_fsdp_qlora_001": Claim(
        "llama-2-7b", RESERVED,
        "Llama-2-7B QLoRA with Answer.AI's train.py on 2 GPUs, FSDP FULL_SHARD: our --method qlora "
        "--quant nf4 --zero 3 on 2 GPUs, pure bf16, LoRA r64 alpha16 dropout 0.1 on q,k,v,gate,up,down (no o_proj), "
        "micro-batch 1 of a dummy dataset at exactly 512 tokens, activation checkpointing per decoder layer, "
        + _ANSWERAI_QLORA_WRAP,
        dict(quant="nf4", precision="bf16", zero=3, lora_alpha=16, lora_dropout=0.1,
             lora_targets="q_proj,k_proj,v_proj,gate_proj,up_proj,down_proj", engine="fsdp1",
             fsdp1_wrap="adapters", lora_adapter_dtype="base")),
    "answerai_fsdp_qlora_005": Claim(
        "llama-2-7b", RESERVED,
        "Llama-2-7B QLoRA with Answer.AI's train.py on 2 GPUs, FSDP FULL_SHARD: our --method qlora "
        "--quant nf4 --zero 3 on 2 GPUs, pure bf16, LoRA r64 alpha16 dropout 0.1 on q,k,v,gate,up,down (no o_proj), "
        "micro-batch 4 of a dummy dataset at exactly 2048 tokens, activation checkpointing per decoder layer, "
        + _ANSWERAI_QLORA_WRAP,
        dict(quant="nf4", precision="bf16", zero=3, lora_alpha=16, lora_dropout=0.1,
             lora_targets="q_proj,k_proj,v_proj,gate_proj,up_proj,down_proj", engine="fsdp1",
             fsdp1_wrap="adapters", lora_adapter_dtype="base")),
}

_HEAD_LORA = ("LoRA on the output layer (lm_head) among the targets, in pure bf16: --lora-targets ...,lm_head is "
              "modelled in fp32 and bf16-mixed on one device or DDP only (--lora-modules-to-save lm_head trains a full "
              "copy of it: another program)")
_NEOX_QLORA = ("QLoRA on stablelm-base-alpha-3b: gpt_neox's 4-bit base is traced (llmem.derive.quant) but this "
               "published figure has not been compared with the estimate yet")

_ANSWERAI_WRAP = ("Answer.AI's train.py wraps each trainable adapter Linear as its own FSDP1 unit "
                  "(get_wrapping_policy, use_orig_params=False), so its decoder layers' units over the bf16-stored "
                  "codes are frozen: --engine fsdp1 --fsdp1-wrap adapters, modelled for QLoRA under FULL_SHARD")

# Rows looked at and not claimed, with the reason (the rules in `unclaimed_reason` cover the rest).
NOT_CLAIMED: dict[str, str] = {
    "torchtune_readme_013": "torchtune's chunked-output cross-entropy (CEWithChunkedOutputLoss) under torch.compile "
                            "(an earlier row of the same cumulative table adds compile; packed samples too), which "
                            "fuses each chunk's fp32 upcast and log_softmax; --loss chunked-ce models the eager "
                            "program only",
    "torchtune_readme_007": "torchtune of September 2024 with torch.compile (and the chunked-output cross-entropy, "
                            "which --loss chunked-ce models only eager): not our eager program",
    "torchtune_readme_029": "bitsandbytes PagedAdamW (32-bit paged states) stepped in backward (optimizer_in_bwd): "
                            "--optimizer-in-backward is modelled for torch's optimizers only (bitsandbytes' in "
                            "backward are refused), and no 32-bit paged AdamW is modelled (--optimizer "
                            "paged-adamw8bit is the 8-bit one)",
    "torchtune_docs_002": _HEAD_LORA,
    "torchtune_docs_004": _HEAD_LORA,
    "litgpt_config_hub_005": _HEAD_LORA,
    "litgpt_config_hub_006": _HEAD_LORA,
    "litgpt_config_hub_025": _HEAD_LORA,
    "litgpt_config_hub_031": _NEOX_QLORA,
    "litgpt_resource_tables_008": _NEOX_QLORA + "; nf4 with double quantization",
    "litgpt_resource_tables_031": "LoRA under FSDP1 (Lightning Fabric's FSDPStrategy wraps FullyShardedDataParallel): "
                                  "--engine fsdp1 models full fine-tuning only (a frozen base and trainable adapters "
                                  "in one FlatParameter is a gap)",
    "answerai_fsdp_qlora_009": _ANSWERAI_WRAP + "; this row runs NO_SHARD, a gap under that wrap",
    "answerai_fsdp_qlora_012": _ANSWERAI_WRAP + " (and Yi-34B has no preset; FSDP1 CPU offload of the parameters "
                               "is a gap)",
    "answerai_fsdp_qlora_013": _ANSWERAI_WRAP + " (and FSDP1 CPU offload of the parameters is a gap)",
    "peft_docs_004": "PEFT's examples/sft/train.py sets fsdp_plugin.auto_wrap_policy = fsdp_auto_wrap_policy(model): "
                     "each trainable adapter Linear its own FSDP1 unit (use_orig_params false in the docs' config), "
                     "so the decoder layers' units over the bf16-stored codes are frozen (--fsdp1-wrap adapters); "
                     "not modelled: packed samples, flash_attention_2, and the statistic is unnamed",
}
