"""The support matrix's rows of context parallelism (`--cp`; `llmem.support.RULES` takes them after the pipeline's).
Each row as in `llmem.support`: the fields it reads, the option it blames, its one-line message with the fix,
REFUSED (the program cannot run) or GAP (it runs, llmem does not model it yet), and an example."""

from __future__ import annotations

from llmem.choices import Attention, Engine, GradCkpt, Loss, Method, Offload
from llmem.errors import GAP, REFUSED
from llmem.support_rule import _r


def context_parallel_rules() -> tuple:
    """The rows (`llmem.support_rule._r`)."""
    return (
    _r("gpus cp", "cp", lambda p: p.cp > 1 and p.gpus % p.cp != 0,
       "--gpus {p.gpus} is not a multiple of --cp {p.cp} (each group of cp GPUs shares a sequence); use --gpus "
       "{p.cp} or a multiple of it", REFUSED, cp=2, gpus=3, zero=3),
    # torch's head-tail load balancer splits the sequence into 2 × cp chunks (`_load_balancer.py`, `_HeadTail...`)
    _r("seq_len cp", "seq-len", lambda p: p.cp > 1 and p.seq_len % (2 * p.cp) != 0,
       "--seq-len {p.seq_len} must be a multiple of 2 × --cp (torch's head-tail load balancer splits it into 2 × cp "
       "chunks); use a multiple of {p.cp} × 2", REFUSED, cp=2, gpus=2, zero=3, seq_len=66),
    # the ring replaces SDPA's kernel; eager attention's matmul-softmax-matmul is not dispatched to it
    _r("cp attn", "attn", lambda p: p.cp > 1 and p.attn is not Attention.SDPA,
       "context parallelism runs inside scaled_dot_product_attention (torch's ring handler); use --attn sdpa", REFUSED,
       cp=2, gpus=2, zero=3, attn="eager"),
    # torchtitan shards over dp_shard × cp whenever cp is on (`parallel_dims.py`: `fsdp_enabled = dp_shard_enabled or
    # cp_enabled`); accelerate 1.15 raises for cp with pure replication (`parallelism_config.py:336-341`)
    _r("cp zero", "zero", lambda p: p.cp > 1 and p.zero in (0, 1),
       "context parallelism runs under FSDP over the cp ranks (torchtitan's dp_shard × cp mesh; accelerate refuses cp "
       "with DDP-style replication): there is no DDP or ZeRO-1 program with cp; use --zero 2 or 3", REFUSED, cp=2,
       gpus=2, zero=0),
    _r("cp gpus tp pp engine", "cp", lambda p: p.cp > 1 and (p.tp > 1 or p.pp > 1 or p.engine is not Engine.TORCH),
       "context parallelism is modelled under FSDP2 over all GPUs (torchtitan's and accelerate's dp_shard × cp), "
       "not with TP, pipeline stages, FSDP1 or DeepSpeed; use --tp 1 --pp 1 --engine torch", GAP, cp=2, gpus=4, tp=2,
       zero=3),
    _r("cp method lora_modules_to_save grad_ckpt loss", "cp", lambda p: p.cp > 1 and (
        p.method is Method.QLORA or p.lora_modules_to_save or p.grad_ckpt is GradCkpt.SELECTIVE
        or p.loss is not Loss.STANDARD),
       "context parallelism is modelled for full fine-tuning and LoRA (no --lora-modules-to-save) with the standard "
       "loss, without checkpointing or with --grad-ckpt full; use --method full/lora --loss standard --grad-ckpt "
       "none/full", GAP, cp=2, gpus=2, zero=3, grad_ckpt="selective"),
    _r("cp offload optimizer_in_backward float8 activation_offload keep_grads fsdp_shard", "cp",
       lambda p: p.cp > 1 and (p.offload is not Offload.NONE or p.optimizer_in_backward or p.float8.value != "none"
                               or p.activation_offload or p.keep_grads or p.fsdp_shard.value != "dim0"),
       "context parallelism is not modelled with offload, the optimizer in backward, float8, activation offload, "
       "kept gradients or --fsdp-shard dim1-if-short; drop them", GAP, cp=2, gpus=2, zero=3, keep_grads=True),
    )
