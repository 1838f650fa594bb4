"""`--float8 tensorwise|rowwise`: torchao 0.18's float8 training of the decoder layers' Linears
(`llmem.components.float8`, `llmem.walk.float8`, `llmem.runtime.float8`).

- One cast's peak (`cast_peak_bytes` + its scale) against torchao's own cast measured by the counting allocator.
- The runtime converts exactly the Linears torchtitan's filter picks (not lm_head, both dims multiples of 16).
- A real CPU run of each recipe where the cast of down_proj's input in backward is the peak: the estimate within 1 %,
  and the growth over the same run without float8 as measured, to 1 % of the peak.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao")

from llmem.components import float8  # noqa: E402
from llmem.estimate import estimate  # noqa: E402
from llmem.plan import TrainingPlan  # noqa: E402
from llmem.spec import ModelSpec  # noqa: E402

WIDE = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 256,
        "tie_word_embeddings": False}


def _cast_extra_bytes(recipe: str, shape: tuple[int, int]) -> int:
    """The counting allocator's peak over one torchao cast of a bf16 tensor, beyond the tensor itself."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    from llmem.measure import counting
    from llmem.runtime.float8 import _import_torchao

    _import_torchao()
    x = torch.randn(shape, dtype=torch.bfloat16)
    rowwise = recipe == "rowwise"
    with counting.CountingTracker() as tracker:
        tracker.reset_peak()
        out = hp_tensor_to_float8_dynamic(
            x, torch.float8_e4m3fn, LinearMMConfig(),
            scaling_granularity=ScalingGranularity.AXISWISE if rowwise else ScalingGranularity.TENSORWISE,
            axiswise_dim=-1 if rowwise else None)
    del out
    return tracker.peak_bytes - tracker.live_at_reset


@pytest.mark.skipif(not __import__("llmem.measure.counting", fromlist=["x"]).available(),
                    reason="needs the counting allocator")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_one_cast_peak_is_torchaos(recipe):
    rows, cols = 96, 160
    plan = TrainingPlan(precision="bf16", float8=recipe)
    assert _cast_extra_bytes(recipe, (rows, cols)) == float8.cast_peak_bytes(rows * cols) + float8.scale_bytes(
        plan, rows)


def test_runtime_converts_torchtitans_filter():
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmem.runtime.float8 import convert

    config = dict(WIDE, intermediate_size=200)  # 200 is no multiple of 16: gate, up and down stay nn.Linear
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).to(torch.bfloat16)
    convert(model, TrainingPlan(precision="bf16", float8="tensorwise"))
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    for name, kind in kinds.items():
        expect = "Linear" if name == "lm_head" or ".mlp." in name else "Float8Linear"
        assert kind == expect, (name, kind)


@pytest.mark.heavy  # the suite's --float8 rows measure it by default (tests/accuracy)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_one_gpu_estimate_and_growth_match_real_runs(recipe):
    from llmem.measure.run import measure_rank

    est, measured = {}, {}
    for f8 in ("none", recipe):
        plan = TrainingPlan(batch_size=2, seq_len=256, precision="bf16", optimizer_impl="forloop", device="cpu",
                            float8=f8)
        est[f8] = estimate(ModelSpec.from_config(WIDE), plan)
        measured[f8] = measure_rank(WIDE, plan)["peak_bytes"]
        assert abs(est[f8].peak_bytes - measured[f8]) <= 0.01 * measured[f8], (f8, est[f8].peak_bytes, measured[f8])
    assert "float8" in est[recipe].peak_phase
    grown_est = est[recipe].peak_bytes - est["none"].peak_bytes
    grown_measured = measured[recipe] - measured["none"]
    assert grown_measured > 0.05 * measured["none"]  # the cast is the peak here: a run without it would not grow
    assert abs(grown_est - grown_measured) <= 0.01 * measured[recipe], (grown_est, grown_measured)
