"""The embeddings' output held by the decoder's forward through its layer loop (`Derived.locals_bytes`, traced):
with LoRA's frozen layer 0 no op saves it, so the traced last layer's forward in flight sits beside it. Checked
against the real CPU step (`measure_rank`, kernel scratch left out): within 1 %, and more than 0.5 % above the walk
without the term (glm4 read -0.74 %, gpt_oss -0.80 % before; docs/notes/2026-11-27-layer-norm-backward.md)."""

from __future__ import annotations

import pytest

from llmem.estimate import estimate
from llmem.plan import TrainingPlan
from llmem.spec import ModelSpec
from tests.derive.configs import config

pytest.importorskip("torch")

PLAN = dict(device="cpu", method="lora", batch_size=2, seq_len=64, precision="fp32", attn="eager",
            optimizer_impl="forloop", lora_targets="q_proj,v_proj")


@pytest.mark.parametrize("family", ["glm4", pytest.param("gpt_oss", marks=pytest.mark.heavy)])
def test_the_held_embeddings_at_the_last_layers_forward(family, monkeypatch):
    from llmem.derive.tables import Derived
    from llmem.measure.run import measure_rank

    cfg, plan = config(family), TrainingPlan(**PLAN)
    est = estimate(ModelSpec.from_config(cfg), plan)
    measured = measure_rank(cfg, plan)["peak_bytes"]
    assert est.peak_phase == "forward (last layer, in flight)"
    assert abs(est.peak_bytes - measured) <= 0.01 * measured, (est.peak_bytes, measured)
    monkeypatch.setattr(Derived, "locals_bytes", lambda *_: 0)
    without = estimate(ModelSpec.from_config(cfg), plan).peak_bytes
    assert without < 0.995 * measured, (without, measured)  # the term is what closes the gap


def test_a_traced_last_layer_in_flight_under_autocast_is_a_gap(monkeypatch):
    """Under autocast the same moment is not pinned down: glm4 LoRA bf16-mixed reads more than 1 % below the real
    step without the check, so the plan is a gap naming `precision`; in fp32 (above) it stands."""
    import importlib

    from llmem.errors import InputError
    from llmem.measure.run import measure_rank

    cfg, plan = config("glm4"), TrainingPlan(**(PLAN | {"precision": "bf16-mixed"}))
    with pytest.raises(InputError) as err:
        estimate(ModelSpec.from_config(cfg), plan)
    assert err.value.field == "precision" and err.value.gap
    module = importlib.import_module("llmem.estimate")  # (the package exports the function under that name)
    monkeypatch.setattr(module, "_check_traced_inflight_under_autocast", lambda *_: None)
    walked = estimate(ModelSpec.from_config(cfg), plan)
    assert walked.peak_phase == "forward (last layer, in flight)"
    assert walked.peak_bytes < 0.99 * measure_rank(cfg, plan)["peak_bytes"]
