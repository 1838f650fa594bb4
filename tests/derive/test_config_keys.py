"""The keys each family reads (`llmem/config_keys.py`) are the ones its transformers config class reads: the
generated file is current, and a config.json written with any mix of the spellings seen in published files gives the
parameter count of the model transformers builds from the same file (counted on the meta device)."""

import runpy
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from llmem.derive.config_keys import SPELLINGS
from llmem.errors import InputError
from llmem.families import FAMILIES
from llmem.spec import ModelSpec

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
# Values that keep every mix valid: heads and KV heads divide every hidden size, experts' top-k fits.
VALUES = {"hidden_size": (128, 256), "num_layers": (1, 2, 3), "num_heads": (2, 4), "num_kv_heads": (1, 2),
          "intermediate_size": (96, 160), "vocab_size": (200, 264), "n_positions": (64, 128),
          "rotary_pct": (0.25, 0.5), "num_experts": (4, 8)}


def test_the_generated_table_is_current():
    render = runpy.run_path(str(ROOT / "scripts" / "gen_config_keys.py"), run_name="gen")["render"]
    assert render() == (ROOT / "llmem" / "config_keys.py").read_text()


@st.composite
def configs(draw):
    model_type = draw(st.sampled_from(sorted(FAMILIES)))
    raw = {"model_type": model_type, "num_experts_per_tok": 2}
    for name, values in VALUES.items():
        for key in dict.fromkeys((name, *SPELLINGS.get(name, ()))):
            if not draw(st.booleans()):
                continue
            value = draw(st.sampled_from(values))
            head, _, leaf = key.partition(".")
            if leaf:
                raw[head] = {"rope_type": "default", "rope_theta": 10000.0, leaf: value}
            else:
                raw[key] = value
    return raw


def _built_params(raw: dict) -> int | None:
    """The parameters of the model transformers builds from `raw` (None if transformers refuses the file)."""
    fields = {k: v for k, v in raw.items() if k != "model_type"}
    try:
        config = transformers.AutoConfig.for_model(raw["model_type"], **fields)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - a mix transformers itself rejects is no test of the keys
        return None
    return sum(p.numel() for p in model.parameters())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_any_mix_of_spellings_counts_the_model_transformers_builds(raw):
    built = _built_params(raw)
    assume(built is not None)
    try:
        spec = ModelSpec.from_config(dict(raw))
    except InputError as e:
        pytest.fail(f"transformers builds {raw} but llmem refuses it: {e}")
    assert spec.total_params == built, raw
