"""The support matrix's refusal of bitsandbytes' optimizers and Adafactor with tensor parallelism
(`llmem.support`, rule "optimizer tp") holds in the real program: on 2 CPU ranks (gloo) a tiny Llama under torch's
hand-written TP plan and an olmo2 under transformers' own plan (`llmem.runtime.parallel._apply_tp`) run a forward
and backward, then each optimizer's first step raises on the DTensor parameters."""

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
OLMO2 = {"model_type": "olmo2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256,
         "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
OPTIMIZERS = ("adamw8bit", "paged-adamw8bit", "adafactor")


def _step_error(config: dict, optimizer: str) -> str:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from llmem.runtime.model import build_model
    from llmem.runtime.optim import make_optimizer
    from llmem.runtime.parallel import _apply_tp

    plan = TrainingPlan(optimizer=optimizer, precision="fp32", device="cpu")  # the optimizer's class and arguments
    torch.manual_seed(0)
    model = build_model(config, plan)
    _apply_tp(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
    optim = make_optimizer([p for p in model.parameters() if p.requires_grad], plan)
    ids = torch.randint(0, config["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    try:
        optim.step()
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"[:300]
    return ""


def _worker(out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    result = {f"{cfg['model_type']} {o}": _step_error(cfg, o) for cfg in (LLAMA, OLMO2) for o in OPTIMIZERS}
    with open(f"{out}.{dist.get_rank()}", "w") as f:
        json.dump(result, f)
    dist.barrier()
    os._exit(0)


@pytest.mark.heavy
def test_each_optimizer_step_raises_on_tp_dtensors(tmp_path):
    for res in run_module_on_two_ranks("tests.runtime.test_tp_optimizers", tmp_path / "r"):
        for case, error in res.items():
            assert error, f"{case}: the step ran; the refusal does not hold"
            assert "DTensor" in error or "sharding strategy" in error or "placement" in error, (case, error)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_the_plan_is_refused_naming_the_optimizer(optimizer):
    with pytest.raises(InputError) as err:
        TrainingPlan(gpus=2, tp=2, optimizer=optimizer)
    assert err.value.field == "optimizer" and err.value.kind == REFUSED and "--tp 1" in str(err.value)


if __name__ == "__main__":
    _worker(sys.argv[1])
