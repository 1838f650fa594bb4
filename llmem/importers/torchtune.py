"""torchtune recipe YAML (`tune run <recipe> --config x.yaml`): the model builder (lora_ / qlora_ and its LoRA
arguments), batch_size, gradient_accumulation_steps, dtype (torchtune trains in it: pure bf16), activation
checkpointing, the optimizer component, max_seq_len and FSDP2 resharding. Component names are only read as text:
nothing a recipe names is imported."""

from __future__ import annotations

from llmem.importers import common
from llmem.importers.core import Reader

NAME = "torchtune recipe"
NO_EFFECT = frozenset("""
tokenizer checkpointer resume_from_checkpoint save_adapter_weights_only dataset seed shuffle lr_scheduler epochs
max_steps_per_epoch output_dir metric_logger log_every_n_steps log_peak_memory_stats log_level device profiler
clip_grad_norm custom_sharded_layers compile_loss
""".split())
DTYPE = {"bf16": "bf16", "fp32": "fp32", "fp16": "fp16"}
OPTIMIZERS = {"torch.optim.AdamW": "adamw", "torch.optim.Adam": "adamw", "torch.optim.SGD": "sgd",
              "bitsandbytes.optim.AdamW8bit": "adamw8bit", "bitsandbytes.optim.PagedAdamW8bit": "paged-adamw8bit",
              "torch.optim.Adafactor": "adafactor"}
# torchtune module names -> Hugging Face ones (llmem's targets)
MODULES = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "output_proj": "o_proj"}
MLP = "gate_proj,up_proj,down_proj"
# torchtune builders whose weights are a preset's (the builder's suffix after lora_ / qlora_)
BUILDERS = {"llama3_1_8b": "llama-3.1-8b", "llama3_1_405b": "llama-3.1-405b", "llama3_2_1b": "llama-3.2-1b",
            "llama3_2_3b": "llama-3.2-3b", "llama2_7b": "llama-2-7b", "llama2_13b": "llama-2-13b",
            "llama2_70b": "llama-2-70b", "qwen2_5_0_5b": "qwen2.5-0.5b", "qwen2_5_1_5b_base": "qwen2.5-1.5b",
            "qwen2_5_3b": "qwen2.5-3b", "qwen2_5_7b_base": "qwen2.5-7b", "qwen2_5_14b_base": "qwen2.5-14b",
            "qwen2_5_32b_base": "qwen2.5-32b", "qwen2_5_72b_base": "qwen2.5-72b", "gemma2_2b": "gemma-2-2b",
            "gemma2_27b": "gemma-2-27b", "phi3_mini": "phi-3-mini-4k-instruct", "qwen3_0_6b_base": "qwen3-0.6b",
            "qwen3_1_7b_base": "qwen3-1.7b", "qwen3_4b_base": "qwen3-4b", "qwen3_8b_base": "qwen3-8b",
            "qwen3_14b_base": "qwen3-14b", "qwen3_32b": "qwen3-32b"}


def matches(tree: dict, name: str) -> bool:
    return any(isinstance(v, dict) and "_component_" in v for v in tree.values())


def read(r: Reader) -> None:
    _model(r)
    r.copy((("batch_size", "batch_size"), ("gradient_accumulation_steps", "grad_accum")))
    dtype = (r.text("dtype") or "").strip().lower()
    if dtype in DTYPE:
        r.set("dtype", "precision", DTYPE[dtype], "torchtune keeps weights, gradients and optimizer states in it "
              "(no autocast)" if dtype != "fp32" else "")
    ckpt = r.flag("enable_activation_checkpointing")
    if isinstance(ckpt, bool):
        r.set("enable_activation_checkpointing", "grad_ckpt", "full" if ckpt else "none")
    if r.has("tokenizer.max_seq_len"):
        r.set("tokenizer.max_seq_len", "seq_len", r.get("tokenizer.max_seq_len"),
              "packed: every sequence this long" if r.flag("dataset.packed") is True else
              "the longest a sequence may be: batches are padded to their longest sequence (an upper bound)")
    _optimizer(r)
    reshard = r.flag("fsdp_reshard_after_forward")
    if isinstance(reshard, bool):
        r.set("fsdp_reshard_after_forward", "zero", 3 if reshard else 2, "the distributed recipes' FSDP2 "
              "fully_shard (give --gpus: tune run --nproc_per_node)")
    if r.flag("fsdp_cpu_offload") is True:
        r.set("fsdp_cpu_offload", "offload", "optimizer+params", "FSDP2 CPUOffloadPolicy")
    common.not_modelled(r, ("enable_activation_offloading", "optimizer_in_bwd", "compile"))
    _loss(r)
    r.finish(NO_EFFECT)


def _loss(r: Reader) -> None:
    """CEWithChunkedOutputLoss (eager: with `compile` its chunks' upcast and log_softmax fuse, not modelled) is
    `--loss chunked-ce`, its `num_output_chunks` (default 8) `--loss-chunks`; other losses but plain cross-entropy
    are not modelled."""
    component = r.text("loss._component_")
    if component is None:
        return
    if component.rsplit(".", 1)[-1] == "CEWithChunkedOutputLoss" and r.flag("compile") is not True:
        r.set("loss._component_", "loss", "chunked-ce", "torchtune's chunked-output cross-entropy, eager")
        if r.has("loss.num_output_chunks"):
            r.set("loss.num_output_chunks", "loss_chunks", r.get("loss.num_output_chunks"))
    elif "CrossEntropy" not in component:
        r.ignore("loss._component_", "this loss of torchtune is not modelled (with compile: true, nor the chunked "
                 "one); estimated with the standard loss")


def _model(r: Reader) -> None:
    component = r.text("model._component_")
    if component is None:
        return
    builder = component.rsplit(".", 1)[-1]
    base = builder.removeprefix("qlora_").removeprefix("lora_")
    if base in BUILDERS:
        r.set("model._component_", "model", BUILDERS[base], f"torchtune's {base} has this preset's weights")
    else:
        r.ignore("model._component_", "not a builder llmem maps to a preset: pass --model")
    if builder.startswith("qlora_"):
        r.set("model._component_", "method", "qlora", "LoRA over torchao's NF4 base (llmem models bitsandbytes' "
              "nf4: the same 4-bit codes and block scales)")
        r.set("model._component_", "quant", "nf4")
    elif builder.startswith("lora_"):
        r.set("model._component_", "method", "lora")
    else:
        return
    r.copy((("lora_rank", "lora_rank"), ("lora_alpha", "lora_alpha"), ("lora_dropout", "lora_dropout")), "model.")
    _targets(r)


def _targets(r: Reader) -> None:
    attn = r.get("model.lora_attn_modules", [])
    if not isinstance(attn, list) or not all(isinstance(m, str) for m in attn):
        r.ignore("model.lora_attn_modules", "expected a list of module names")
        return
    names = [MODULES.get(m, m) for m in attn]
    if r.flag("model.apply_lora_to_mlp") is True:
        names.append(MLP)
    if r.flag("model.apply_lora_to_output") is True:
        names.append("lm_head")
    if names:
        r.set("model.lora_attn_modules", "lora_targets", ",".join(names), "torchtune's names as Hugging Face's "
              "(output_proj = o_proj, the MLP's w1/w3/w2 = gate_proj/up_proj/down_proj, the output layer = "
              "lm_head)", shown=attn)


def _optimizer(r: Reader) -> None:
    component = r.text("optimizer._component_")
    if component is None:
        return
    if component in OPTIMIZERS:
        r.set("optimizer._component_", "optimizer", OPTIMIZERS[component])
        fused = r.flag("optimizer.fused")
        if fused is True and OPTIMIZERS[component] in ("adamw", "sgd"):
            r.set("optimizer.fused", "optimizer_impl", "fused")
    else:
        r.ignore("optimizer._component_", "not modelled (llmem: torch AdamW/SGD/Adafactor, bitsandbytes AdamW8bit, "
                 "PagedAdamW8bit): pass --optimizer")
