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
    statistic the source measured and why the row matches our program (and where it knowingly differs)."""

    preset: str
    statistic: str
    why: str
    plan: dict = field(default_factory=dict)


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
}

# Close to our program but not it: run with FSDP1 (FullyShardedDataParallel: flat parameters per wrapped unit,
# side-stream all-gathers and reduce-scatters kept alive by recordStream) where DESIGN.md §2 runs FSDP2's
# fully_shard. Estimated and shown for reference in docs/PUBLISHED.md; they do not count toward the bound.
REFERENCE: dict[str, Claim] = {
    "torchtune_readme_027": Claim(
        "llama-2-7b", RESERVED,
        "Llama-2-7B LoRA r8 alpha16 on q,v (torchtune's 7B_lora config: no MLP or output adapters, activation "
        "checkpointing off) with lora_finetune_distributed on 2 GPUs, FULL_SHARD = our --zero 3 on 2 GPUs, pure "
        "bf16, torch AdamW, micro-batch 2 padded to the longest Alpaca sample (max 512: the upper end); LoRA "
        "dropout 0.05 (the builder's default then). The README does not name the statistic: compared with "
        "reserved_bytes, as the torchtune tutorial of the same month (torchtune_docs_003) reports reserved memory. "
        "Differs: torchtune of April 2024 sharded with FSDP1 (FullyShardedDataParallel: flat parameters per "
        "wrapped unit, all-gathers on a side stream kept alive by recordStream, backward prefetch of the next unit) "
        "where our program runs FSDP2's fully_shard; torchtune's own Llama code (bf16 adapters); the figure is an "
        "average over several runs.",
        dict(precision="bf16", zero=3, seq_len=512, lora_alpha=16, lora_dropout=0.05, lora_targets=_LORA_QV)),
    "torchtune_readme_030": Claim(
        "llama-2-7b", RESERVED,
        "Llama-2-7B full fine-tune with torchtune's full_finetune_distributed (7B_full) on 4 GPUs, FULL_SHARD = our "
        "--zero 3 on 4 GPUs, pure bf16 (bf16 AdamW states), torch AdamW, micro-batch 2 padded to the longest "
        "Alpaca sample (max 512: the upper end), activation checkpointing per layer (--grad-ckpt full). Statistic "
        "not named by the README: reserved_bytes, as torchtune_readme_027. Differs: FSDP1 instead of FSDP2 (see "
        "torchtune_readme_027; FSDP1 also holds each unit's unsharded flat gradient until its reduce-scatter on "
        "the side stream completes); torchtune's own Llama code.",
        dict(precision="bf16", zero=3, seq_len=512)),
    "answerai_fsdp_qlora_008": Claim(
        "llama-2-7b", RESERVED,
        "Llama-2-7B LoRA (train_type lora: PEFT) with Answer.AI's train.py on 2 GPUs, FSDP FULL_SHARD = our --zero 3 "
        "on 2 GPUs, pure bf16 (no MixedPrecision policy), torch AdamW on the adapters, LoRA r64 alpha16 dropout 0.1 "
        "on q,k,v,gate,up,down (lora_target_modules all: no o_proj), micro-batch 6 of a dummy dataset at exactly "
        "2048 tokens, activation checkpointing per decoder layer, peak reserved memory (reported in GiB, converted "
        "to GB). Differs: FSDP1 instead of FSDP2 (see torchtune_readme_027); the model, adapters included, is cast "
        "to bf16 before wrapping (our PEFT adapters are fp32: their AdamW states and gradients are larger here); "
        "reentrant checkpointing; and transformers of March 2024 upcast the whole logits to fp32 inside the "
        "model (logits.float()) and shifted them with .contiguous() copies before the loss, where today's "
        "transformers upcasts inside the loss only - about 1.6 GB of extra fp32 logits at 6 x 2048 x 32000.",
        dict(precision="bf16", zero=3, seq_len=2048, grad_ckpt="full", lora_alpha=16, lora_dropout=0.1,
             lora_targets="q_proj,k_proj,v_proj,gate_proj,up_proj,down_proj")),
    "answerai_fsdp_qlora_001": Claim(
        "llama-2-7b", RESERVED,
        "Llama-2-7B QLoRA with Answer.AI's train.py on 2 GPUs, FSDP FULL_SHARD: estimated as our --method qlora "
        "--quant nf4 --zero 3 on 2 GPUs, pure bf16, LoRA r64 alpha16 dropout 0.1 on q,k,v,gate,up,down (no o_proj), "
        "micro-batch 1 of a dummy dataset at exactly 512 tokens, activation checkpointing per decoder layer, "
        "reserved memory. A different program, so not claimed: FSDP1 with bnb_4bit_quant_storage=bf16 (the packed "
        "codes stored as bf16 so that FSDP1's flat parameters hold one dtype), its own LoRA layers cast to bf16 "
        "(ours are PEFT's fp32 adapters), reentrant checkpointing, March "
        "2024 transformers (fp32 logits upcast inside the model), and our FSDP2 all-gathers the uint8 codes with the "
        "adapters as bytes.",
        dict(quant="nf4", precision="bf16", zero=3, lora_alpha=16, lora_dropout=0.1,
             lora_targets="q_proj,k_proj,v_proj,gate_proj,up_proj,down_proj")),
    "answerai_fsdp_qlora_005": Claim(
        "llama-2-7b", RESERVED,
        "Llama-2-7B QLoRA with Answer.AI's train.py on 2 GPUs, FSDP FULL_SHARD: estimated as our --method qlora "
        "--quant nf4 --zero 3 on 2 GPUs, pure bf16, LoRA r64 alpha16 dropout 0.1 on q,k,v,gate,up,down (no o_proj), "
        "micro-batch 4 of a dummy dataset at exactly 2048 tokens, activation checkpointing per decoder layer, "
        "reserved memory. A different program, so not claimed: FSDP1 with bnb_4bit_quant_storage=bf16 (the packed "
        "codes stored as bf16 so that FSDP1's flat parameters hold one dtype), its own LoRA layers cast to bf16 "
        "(ours are PEFT's fp32 adapters), reentrant checkpointing, March "
        "2024 transformers (fp32 logits upcast inside the model), and our FSDP2 all-gathers the uint8 codes with the "
        "adapters as bytes.",
        dict(quant="nf4", precision="bf16", zero=3, lora_alpha=16, lora_dropout=0.1,
             lora_targets="q_proj,k_proj,v_proj,gate_proj,up_proj,down_proj")),
}

# Rows looked at and not claimed, with the reason (the rules in `unclaimed_reason` cover the rest).
NOT_CLAIMED: dict[str, str] = {
    "torchtune_readme_013": "torchtune's chunked-output cross-entropy (CEWithChunkedOutputLoss) under torch.compile "
                            "(an earlier row of the same table adds compile), which fuses each chunk's fp32 upcast "
                            "and log_softmax; --loss chunked-ce models the eager program only",
    "torchtune_readme_007": "torchtune of September 2024: torch.compile and the chunked-output cross-entropy "
                            "(CEWithChunkedOutputLoss; see torchtune_readme_013): neither is our program",
    "torchtune_readme_029": "bitsandbytes PagedAdamW (32-bit paged states) with optimizer_in_bwd (each gradient "
                            "freed right after its parameter's step): neither is modelled (--optimizer "
                            "paged-adamw8bit is the 8-bit one, stepping after backward)",
    "torchtune_docs_002": "LoRA on the output projection (lm_head), which is not modelled",
    "torchtune_docs_004": "LoRA on the output projection (lm_head), which is not modelled",
    "litgpt_config_hub_005": "LoRA on the output head (lm_head), which is not modelled",
    "litgpt_config_hub_006": "LoRA on the output head (lm_head), which is not modelled",
    "litgpt_config_hub_024": "microsoft/phi-2 (PhiForCausalLM): no preset",
    "litgpt_config_hub_025": "microsoft/phi-2 (PhiForCausalLM): no preset; LoRA on the head too",
    "litgpt_config_hub_031": "stabilityai/stablelm-base-alpha-3b (GPT-NeoX layout, LitGPT code): no preset",
    "litgpt_resource_tables_001": "microsoft/phi-1_5 (PhiForCausalLM): no preset",
    "litgpt_resource_tables_005": "microsoft/phi-1_5 (PhiForCausalLM): no preset",
    "litgpt_resource_tables_008": "stabilityai/stablelm-base-alpha-3b: no preset",
    "litgpt_resource_tables_009": "stabilityai/stablelm-base-alpha-3b: no preset",
    "litgpt_resource_tables_031": "microsoft/phi-1_5 (PhiForCausalLM): no preset",
    "answerai_fsdp_qlora_012": "QLoRA with a sharded 4-bit base (FSDP1) is not modelled (and Yi-34B has no "
                               "preset; FSDP CPU offload of the 4-bit parameters)",
    "answerai_fsdp_qlora_013": "QLoRA with a sharded 4-bit base (FSDP1) is not modelled (and FSDP1 CPU offload of "
                               "the 4-bit parameters)",
}
