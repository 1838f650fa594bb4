"""`--cp`: torch's ring attention on its sequence shards (`llmem.components.context_parallel`,
`llmem.walk.context_parallel`, `llmem.runtime.context_parallel`).

The ring on CPU runs torch's `_templated_ring_attention` with the CPU flash kernel registered beside torch's CUDA ones:
checked against plain SDPA on the whole sequence (the same loss and gradients), and unpatched torch checked to refuse
the CPU kernel (why the handler exists). Each row's estimate against the measured max-over-ranks peak (2 ranks, gloo),
within 1 %; the attention-heavy row puts the peak inside the ring's backward."""

from __future__ import annotations

import json
import os
import sys

import pytest

from llmem.errors import InputError
from llmem.plan import TrainingPlan
from tests.components.multirank import TwoRankRows, run_module_on_two_ranks

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256,
         "tie_word_embeddings": False}
# wide attention, a narrow MLP, a small vocabulary: the ring's backward buffers are the peak
ATTENTION = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 64, "max_position_embeddings": 1024,
             "tie_word_embeddings": False}

BASE = dict(gpus=2, zero=3, cp=2, precision="fp32", optimizer_impl="forloop", batch_size=2, seq_len=64)
ROWS = {
    "fp32": {},
    "ring-fp32": dict(batch_size=1, seq_len=512),
    "bf16-mixed": dict(precision="bf16-mixed", seq_len=128),
    "zero2-bf16-mixed": dict(zero=2, precision="bf16-mixed", seq_len=128),
}
RUNS = TwoRankRows(BASE, ROWS, lambda name: dict(ATTENTION if name.startswith("ring") else LLAMA), sampled=("fp32",))


@pytest.mark.parametrize("name", RUNS.params())
def test_within_1_percent_of_the_measured_peak(name):
    RUNS.check(name, tolerance=0.01)


def _worker(out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    from llmem.runtime.context_parallel import attach_mask_hooks, enable_cpu_kernel, shard_inputs
    from llmem.runtime.model import build_model

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    q = torch.randn(1, 4, 16, 8, generator=torch.Generator().manual_seed(3))
    refused = ""
    try:  # torch as shipped: the CPU kernel has no sharding rule under the context
        with context_parallel(mesh, buffers=[q.clone()], buffer_seq_dims=[2]):
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    except NotImplementedError as exc:
        refused = str(exc)
    plan = TrainingPlan(**{**BASE, "device": "cpu"})
    torch.manual_seed(1234)
    model = build_model(LLAMA, plan)
    ids = torch.randint(0, LLAMA["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(7))
    reference = model(input_ids=ids, labels=ids).loss
    reference.backward()
    ref_grad = model.model.layers[0].self_attn.q_proj.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    enable_cpu_kernel()
    attach_mask_hooks(model)
    ctx, inputs = shard_inputs(mesh, ids)
    with ctx:
        tokens = torch.tensor([float((inputs["shift_labels"] != -100).sum())])
        result = model(**inputs)
        loss = result.loss * tokens  # this shard's summed token losses: the ring's backward sends each rank's
        loss.backward()  # key and value gradients to their owners, so the ranks' losses are summed before it
    loss = loss.detach()
    grad = model.model.layers[0].self_attn.q_proj.weight.grad.clone()
    for t in (loss, grad, tokens):
        dist.all_reduce(t)
    result = {"refused": refused, "loss": (loss / tokens).item(), "reference": reference.item(),
              "grad_error": ((grad / tokens - ref_grad).norm() / ref_grad.norm()).item()}
    with open(f"{out}.{dist.get_rank()}", "w") as f:
        json.dump(result, f)
    dist.barrier()
    os._exit(0)


@pytest.mark.heavy
def test_the_ring_on_cpu_computes_plain_attention(tmp_path):
    for res in run_module_on_two_ranks("tests.components.test_context_parallel", tmp_path / "r"):
        assert "_scaled_dot_product_flash_attention_for_cpu" in res["refused"]
        assert res["loss"] == pytest.approx(res["reference"], rel=1e-5)
        assert res["grad_error"] < 1e-4


@pytest.mark.parametrize("fields, blame", [
    (dict(gpus=3, cp=2, zero=3), "cp"),
    (dict(gpus=2, cp=2, zero=3, seq_len=66), "seq-len"),
    (dict(gpus=2, cp=2, zero=3, attn="eager"), "attn"),
    (dict(gpus=2, cp=2, zero=0), "cp"),
    (dict(gpus=4, cp=2, tp=2, zero=3), "cp"),
])
def test_refused_in_one_line(fields, blame):
    with pytest.raises(InputError) as err:
        TrainingPlan(**fields)
    assert err.value.field == blame


def test_other_families_are_a_gap():
    from llmem.estimate import estimate
    from llmem.spec import ModelSpec

    qwen2 = dict(LLAMA, model_type="qwen2")
    with pytest.raises(InputError) as err:
        estimate(ModelSpec.from_config(qwen2), TrainingPlan(**BASE))
    assert err.value.field == "cp" and err.value.kind == "gap"


if __name__ == "__main__":
    _worker(sys.argv[1])
