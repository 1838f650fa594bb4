"""Tensor parallelism with the model's own plan (`llmem.derive.tp`): the per-rank inventory split as transformers'
styles shard it and the activation tables traced on the TP program under torch's fake process group, against the
measured max-over-ranks peak of two CPU ranks (gloo, one torchrun launch), within 1%: fused-QKV families
(gpt_neox's `query_key_value` colwise, phi3's `qkv_proj` colwise_gather_output), derived architectures, Gemma 3's
replicated q/k norms and Qwen3-MoE's packed experts; TP x ZeRO-3 on four ranks. The default suite runs a sample;
the grid with `-m heavy`."""

import pytest

from tests.components.multirank import TwoRankRows
from tests.components.test_activations import CONFIGS
from tests.derive.configs import config

TOLERANCE = 0.01
FAMILIES = ("gpt_neox", "phi3", "phi", "starcoder2", "olmo2", "gemma3_text", "qwen3_moe")
_BASE = {"batch_size": 2, "seq_len": 64, "gpus": 2, "tp": 2, "optimizer_impl": "forloop", "attn": "sdpa"}
GRID = {f"{m}-{precision}-{ckpt}": {"precision": precision, "grad_ckpt": ckpt}
        for m in FAMILIES for precision in ("fp32", "bf16-mixed") for ckpt in ("none", "full")}
SAMPLE = ("olmo2-fp32-none", "qwen3_moe-bf16-mixed-full")


def _config(name: str) -> dict:
    model_type = name.split("-")[0]
    return CONFIGS[model_type] if model_type in CONFIGS else config(model_type)


SAMPLE_RUN = TwoRankRows(_BASE, {n: GRID[n] for n in SAMPLE}, _config)
GRID_RUN = TwoRankRows(_BASE, {n: r for n, r in GRID.items() if n not in SAMPLE}, _config)


@pytest.mark.parametrize("model_type", ["gpt_neox", "phi3", "gemma3_text", "qwen3_moe"])
def test_each_parameters_split_is_the_wrapped_programs_local_shape(model_type):
    """The inventory's TP-local shapes (styles read on the meta device, `split`) against the local tensors of the
    model the runtime wraps (rank 0 of a fake 2-rank group): fused QKV, packed 3-D experts, a vocab-sharded
    embedding and lm_head, replicated norms."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from llmem.components.sharding import tp_local_shape
    from llmem.derive.tp import fake_group, wrap_tp
    from llmem.plan import TrainingPlan
    from llmem.runtime.model import build_model
    from llmem.spec import ModelSpec, hf_tp_spec

    plan = TrainingPlan(gpus=2, tp=2, device="cpu")
    spec = hf_tp_spec(ModelSpec.from_config(_config(model_type)), plan)
    with fake_group(2), FakeTensorMode(allow_non_fake_inputs=True):
        model = wrap_tp(build_model(_config(model_type), plan), 2)
        local = {n: tuple(getattr(p, "_local_tensor", p).shape) for n, p in model.named_parameters()}
    assert {p.name: tp_local_shape(p, 2) for p in spec.params} == local
    assert any(len(s) == 2 and s != p.shape for p in spec.params for s in [tp_local_shape(p, 2)])


@pytest.mark.parametrize("name", SAMPLE)
def test_tp_with_the_models_plan_within_one_percent(name):
    SAMPLE_RUN.check(name, TOLERANCE)


@pytest.mark.heavy
@pytest.mark.parametrize("name", [n for n in GRID if n not in SAMPLE])
def test_tp_grid_within_one_percent(name):
    GRID_RUN.check(name, TOLERANCE)


# TP x FSDP2 (ZeRO-3 over the TP groups) on four CPU ranks: one launch, heavy
Z3 = {f"{m}-bf16-mixed-full": {"precision": "bf16-mixed", "grad_ckpt": "full"} for m in ("gpt_neox", "olmo2")}
Z3_RUN = TwoRankRows({**_BASE, "gpus": 4, "zero": 3}, Z3, _config)


@pytest.mark.heavy
@pytest.mark.parametrize("name", sorted(Z3))
def test_tp_with_zero3_within_one_percent(name):
    Z3_RUN.check(name, TOLERANCE)


@pytest.mark.heavy
@pytest.mark.parametrize("plan", [{"gpus": 2, "tp": 2}, {"gpus": 4, "tp": 2, "zero": 3}], ids=["tp", "tp-zero3"])
def test_full_size_preset_agrees_with_simulate(plan):
    """pythia-1.4b (gpt_neox, fused query_key_value), 1 × 2048, bf16-mixed, full checkpointing: the estimate
    against `simulate` (the same runtime on fake tensors at full size), within 1%."""
    from llmem.estimate import estimate
    from llmem.plan import TrainingPlan
    from llmem.presets import load_preset
    from llmem.simulate.run import simulate
    from llmem.spec import ModelSpec

    config = load_preset("pythia-1.4b")
    p = TrainingPlan(batch_size=1, seq_len=2048, precision="bf16-mixed", grad_ckpt="full", **plan)
    sim = simulate(config, p).peak_bytes
    est = estimate(ModelSpec.from_config(config), p).peak_bytes
    assert abs(est - sim) <= TOLERANCE * sim, (est, sim)
