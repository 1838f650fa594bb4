"""QLoRA on 2 processes (DDP, ZeRO-1): real torchrun (gloo, CPU) runs, estimate within 3 % of the measured
max-over-ranks peak (the multi-rank bar), and what DDP's construction does to the 4-bit base.

Every rank holds the whole 4-bit base (bitsandbytes `Params4bit`, frozen) and the fp32 adapters. DDP's
`_sync_module_states` broadcasts every parameter from rank 0 at construction, frozen ones included: for a
`Params4bit` that is its packed uint8 codes, in place; its `quant_state` (absmax, code table) is no parameter or
buffer and is not sent. With identical weights on every rank (one checkpoint loaded everywhere; here one seed) the
broadcast changes nothing; `test_ddp_keeps_the_4bit_base_intact` checks that, and that the adapters' gradients agree
across ranks after a backward."""

from __future__ import annotations

import json
import os
import sys

import pytest

from llmem.estimate import estimate
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from tests.components.multirank import TwoRankRows, run_module_on_two_ranks
from tests.components.test_activations import CONFIGS
from tests.test_estimate_multirank import CONFIG, LARGE, LARGE_BASE

BASE = {"batch_size": 2, "seq_len": 64, "precision": "fp32", "optimizer": "adamw", "optimizer_impl": "forloop",
        "method": "qlora", "quant": "nf4", "lora_dropout": 0.0, "gpus": 2}
ROWS = {
    "ddp-fp32": {"zero": 0},
    "ddp-bf16": {"zero": 0, "precision": "bf16"},
    "zero1-fp32": {"zero": 1},
    "zero1-bf16-fp4-ckpt": {"zero": 1, "precision": "bf16", "quant": "fp4", "grad_ckpt": "full"},
    "qwen3-ddp-bf16-dropout": {"zero": 0, "precision": "bf16", "lora_dropout": 0.1},
    "large-ddp-fp32": {"zero": 0, **LARGE_BASE},  # parameter-dominated: the adapters' DDP bucket matters
    "large-zero1-bf16": {"zero": 1, "precision": "bf16", **LARGE_BASE},
}


def config_of(name: str) -> dict:
    """A row's model: qwen3-* the qwen3 config, large-* the parameter-dominated llama, others the test llama."""
    if name.startswith("qwen3-"):
        return CONFIGS["qwen3"]
    return LARGE if name.startswith("large-") else CONFIG


# The suite's cover (tests/accuracy) measures this scheme by default; these rows under -m heavy.
RUN = TwoRankRows(BASE, ROWS, config_of, sampled=())


@pytest.mark.parametrize("name", list(ROWS))
def test_qlora_two_processes(name):
    pytest.importorskip("bitsandbytes")
    RUN.check(name)


def test_ddp_adds_the_adapter_bucket_to_the_single_gpu_estimate():
    """DDP's Reducer buckets only parameters that require grad: one fp32 copy of the adapters, nothing of the base."""
    one = TrainingPlan(**{**BASE, "gpus": 1, "device": "cpu"})
    ddp = one.with_(gpus=2, zero=0)
    spec = ModelSpec.from_config(CONFIG)
    est_one, est_ddp = estimate(spec, one), estimate(spec, ddp)
    assert est_ddp.peak_bytes - est_one.peak_bytes == 4 * est_one.trainable_params


# --- DDP construction on a 4-bit base (run under torchrun by the test below) ---------------------------------------

def _ddp_worker(out: str) -> None:
    import bitsandbytes as bnb
    import torch
    import torch.distributed as dist

    from llmem.runtime.lora import apply_method
    from llmem.runtime.model import build_model
    from llmem.runtime.parallel import wrap

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    plan = TrainingPlan(**{**BASE, "precision": "bf16", "seq_len": 16, "device": "cpu"})
    torch.manual_seed(1234)
    model = apply_method(build_model(CONFIG, plan), plan)
    quantized = {n: p for n, p in model.named_parameters() if isinstance(p, bnb.nn.Params4bit)}
    before = {n: (p.data.clone(), p.data_ptr(), p.quant_state.absmax.clone()) for n, p in quantized.items()}
    ddp = wrap(model, plan)
    after = dict(ddp.module.named_parameters())
    intact = all(isinstance(after[n], bnb.nn.Params4bit) and after[n].quant_state is not None
                 and after[n].data_ptr() == ptr and torch.equal(after[n].data, codes)
                 and torch.equal(after[n].quant_state.absmax, absmax)
                 for n, (codes, ptr, absmax) in before.items())
    bucketed = sum(p.numel() for p in ddp.parameters() if p.requires_grad)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(7 + rank))
    ddp(input_ids=ids, labels=ids).loss.backward()
    grads = torch.cat([p.grad.flatten() for p in ddp.parameters() if p.requires_grad])
    reference = grads.clone()
    dist.broadcast(reference, 0)
    result = {"rank": rank, "quantized": len(quantized), "intact": intact, "bucketed": bucketed,
              "grads_equal": bool(torch.equal(grads, reference)),
              "base_grads": sum(p.grad is not None for p in quantized.values())}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    # Both ranks have written; leave without tearing gloo down (its teardown hung one rank now and then, as it
    # aborted the measure worker at exit: llmem/measure/worker.py leaves the same way)
    dist.barrier()
    os._exit(0)


def test_ddp_keeps_the_4bit_base_intact(tmp_path):
    pytest.importorskip("bitsandbytes")
    results = run_module_on_two_ranks("tests.components.test_qlora_multirank", tmp_path / "r")
    spec, plan = ModelSpec.from_config(CONFIG), TrainingPlan(**{**BASE, "precision": "bf16"})
    trainable = estimate(spec, plan).trainable_params
    for res in results:
        assert res["quantized"] == 7 * CONFIG["num_hidden_layers"]  # q k v o gate up down per layer
        assert res["intact"], res  # same object, same codes, same absmax after DDP's broadcast
        assert res["bucketed"] == trainable and res["base_grads"] == 0
        assert res["grads_equal"], res  # the all-reduce ran: both ranks hold the same adapter gradients


if __name__ == "__main__":
    _ddp_worker(sys.argv[1])
