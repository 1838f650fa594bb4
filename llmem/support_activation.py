"""The support matrix's rows for `--activation-offload` (torchtune's OffloadActivations; `llmem.support.RULES` appends
them): where torchtune's recipes refuse to run it, and what is not modelled yet."""

from __future__ import annotations

from llmem.choices import Device, Engine, GradCkpt, Loss, Method
from llmem.errors import GAP, REFUSED
from llmem.support_rule import _r


def activation_offload_rules() -> tuple:
    """The rows, made with `llmem.support_rule._r`."""
    on = "activation_offload"
    return (
        # recipes/full_finetune_single_device.py:166-170 (and every recipe): RuntimeError unless the device is CUDA
        _r(f"{on} device", "activation-offload", lambda p: p.activation_offload and p.device is Device.CPU,
           "torchtune's activation offloading runs only on CUDA (its recipes raise otherwise: pinned host copies and a "
           "copy stream); use --device cuda, or leave --activation-offload off", REFUSED, activation_offload=True,
           device="cpu", grad_ckpt="full"),
        # :171-174: RuntimeError unless enable_activation_checkpointing
        _r(f"{on} grad_ckpt", "activation-offload",
           lambda p: p.activation_offload and p.grad_ckpt is GradCkpt.NONE,
           "torchtune's recipes run activation offloading only with activation checkpointing (they raise without "
           "it); add --grad-ckpt full, or leave --activation-offload off", REFUSED, activation_offload=True),
        _r(f"{on} grad_ckpt ckpt_every", "activation-offload",
           lambda p: p.activation_offload and (p.grad_ckpt is GradCkpt.SELECTIVE or p.ckpt_every > 1),
           "activation offloading is modelled with every decoder layer checkpointed, as torchtune's recipes wrap "
           "them; use --grad-ckpt full --ckpt-every 1", GAP, activation_offload=True, grad_ckpt="selective"),
        # several GPUs: DDP, ZeRO-1, FSDP2 (--zero 2 and 3, the loss after the root's forward as in torchtune's
        # recipes) and tensor parallelism checked against the simulation; pipeline parallelism, FSDP1 and DeepSpeed
        # not yet
        _r(f"{on} gpus pp engine", "activation-offload",
           lambda p: p.activation_offload and (p.pp > 1 or p.gpus > 1 and p.engine is not Engine.TORCH),
           "activation offloading is modelled on several GPUs with DDP, FSDP2 (--zero 1, 2, 3) and --tp so far "
           "({p.strategy_label} not yet); use --pp 1 --engine torch, or leave --activation-offload off", GAP,
           activation_offload=True, grad_ckpt="full", gpus=2, engine="fsdp1"),
        # LoRA: the manager keeps the last backward node it saw (`curr_autograd_node`, :265) into the next
        # iteration, and its graph holds PEFT's input-require-grads leaf (the embedding output) with its gradient:
        # simulated 3-4 x tokens x hidden x 2 bytes above the full fine-tuning terms, not derived yet
        _r(f"{on} method loss", "activation-offload",
           lambda p: p.activation_offload and (p.method is not Method.FULL or p.loss is Loss.FUSED_LINEAR_CE),
           "activation offloading is modelled for --method full with --loss standard or chunked-ce so far (with "
           "{p.method.value} the previous backward's graph, which the offloading manager keeps, holds the embedding "
           "output and its gradient: not modelled yet); use --method full, or leave --activation-offload off",
           GAP, activation_offload=True, grad_ckpt="full", method="lora"),
    )
