"""The support matrix's refusal of the 8-bit base under FSDP2 (`llmem.support`, rule "method quant gpus zero engine")
holds in the real program: on 2 CPU ranks (gloo) a tiny Llama quantized as transformers' loader does
(`llmem.runtime.lora.apply_method`, bitsandbytes `Linear8bitLt`) and sharded per layer and at the root as the
runtime does (`llmem.runtime.parallel._apply_fsdp`) fails in its first forward: FSDP2's sharded Parameter has no
`CB`/`SCB`. DDP and ZeRO-1 over the same base run and are estimated (tests/accuracy `d2-*-qlora-int8-*`)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from llmem.errors import REFUSED, InputError
from llmem.plan import TrainingPlan
from tests.components.multirank import run_module_on_two_ranks

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256,
         "tie_word_embeddings": False}


def _worker(out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from llmem.runtime.lora import apply_method
    from llmem.runtime.model import build_model
    from llmem.runtime.parallel import _apply_fsdp

    dist.init_process_group("gloo")
    plan = TrainingPlan(method="qlora", quant="int8", precision="bf16", device="cpu")  # the one-GPU plan's base
    torch.manual_seed(0)
    model = apply_method(build_model(LLAMA, plan), plan)
    _apply_fsdp(model, plan, init_device_mesh("cpu", (2,)), reshard=True)
    ids = torch.randint(0, LLAMA["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    try:
        model(input_ids=ids, labels=ids).loss.backward()
        error = ""
    except Exception as exc:  # noqa: BLE001 - the message is the result
        error = f"{type(exc).__name__}: {exc}"[:300]
    with open(f"{out}.{dist.get_rank()}", "w") as f:
        json.dump({"error": error}, f)
    dist.barrier()
    os._exit(0)


@pytest.mark.heavy
def test_fsdp2_over_an_8bit_base_fails_in_the_forward(tmp_path):
    for res in run_module_on_two_ranks("tests.runtime.test_int8_fsdp", tmp_path / "r"):
        assert "CB" in res["error"] or "SCB" in res["error"], res


@pytest.mark.parametrize("zero", [2, 3])
def test_the_plan_is_refused_naming_quant(zero):
    with pytest.raises(InputError) as err:
        TrainingPlan(method="qlora", quant="int8", precision="bf16", gpus=2, zero=zero)
    assert err.value.field == "quant" and err.value.kind == REFUSED


if __name__ == "__main__":
    _worker(sys.argv[1])
