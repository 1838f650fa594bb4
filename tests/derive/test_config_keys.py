"""The config.json keys each family reads (`llmem/config_keys.py`) are those its modeling code reads: a config written
with any mix of the spellings seen in published files describes, to llmem, the model transformers builds from the
same dict (counted on the meta device): its parameter count, its attention's head_dim and heads per KV head, and
GPT-NeoX's rotary width. The generated file is current (`-m heavy`: regenerating it builds ~900 small models)."""

import runpy
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from llmem.config_keys import KEYS
from llmem.derive.config_keys import SPELLINGS
from llmem.errors import InputError
from llmem.families import FAMILIES
from llmem.spec import ModelSpec

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
# Values that keep every mix valid: heads and KV heads divide every hidden size, the experts' top-k fits.
VALUES = {"hidden_size": (128, 256), "num_layers": (1, 2, 3), "num_heads": (2, 4), "num_kv_heads": (1, 2),
          "head_dim": (16, 32), "intermediate_size": (96, 160), "vocab_size": (200, 264), "n_positions": (64, 128),
          "rotary_pct": (0.25, 0.5), "num_experts": (4, 8), "tie_word_embeddings": (True, False)}
# Layouts that decide whether a key is read at all (`llmem.derive.config_keys.VARIANTS`)
LAYOUTS = {"falcon": {"new_decoder_architecture": (False, True), "multi_query": (False, True)},
           "qwen2_moe": {"mlp_only_layers": ([], [0]), "decoder_sparse_step": (1, 2)}}


@st.composite
def configs(draw):
    model_type = draw(st.sampled_from(sorted(FAMILIES)))
    raw = {"model_type": model_type, "num_experts_per_tok": 2, "pad_token_id": None}
    for key, values in LAYOUTS.get(model_type, {}).items():
        raw[key] = draw(st.sampled_from(values))
    for name, values in VALUES.items():
        for key in SPELLINGS[name]:
            if not draw(st.booleans()):
                continue
            value = draw(st.sampled_from(values))
            head, _, leaf = key.partition(".")
            if leaf:
                raw[head] = {"rope_type": "default", "rope_theta": 10000.0, leaf: value}
            else:
                raw[key] = value
    return raw


def _built(raw: dict):
    """The model transformers builds from `raw` on the meta device (None if transformers refuses the dict)."""
    fields = {k: v for k, v in raw.items() if k != "model_type"}
    try:
        config = transformers.AutoConfig.for_model(raw["model_type"], **fields)
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - a mix transformers itself rejects is no test of the keys
        return None


def _check(raw: dict) -> None:
    model = _built(raw)
    assume(model is not None)
    attention = next(m for m in model.modules() if type(m).__name__.endswith("Attention"))
    try:
        spec = ModelSpec.from_config(dict(raw))
    except InputError as e:  # right only where the model cannot run: more KV heads than heads (`repeat_kv` by 0)
        assert getattr(attention, "num_key_value_groups", None) == 0, f"{raw}: llmem refuses it: {e}"
        return
    assert spec.total_params == sum(p.numel() for p in model.parameters()), raw
    if hasattr(attention, "head_dim"):
        assert spec.head_dim == attention.head_dim, raw
    if hasattr(attention, "num_key_value_groups"):
        assert spec.num_heads // spec.num_kv_heads == attention.num_key_value_groups, raw
    if spec.family.partial_rotary:  # GPT-NeoX: the rotated width, from the nested rope_parameters or rotary_pct
        inv_freq = next(b for n, b in model.named_buffers() if n.endswith("rotary_emb.inv_freq"))
        assert 2 * inv_freq.shape[0] == int(spec.head_dim * spec.options["rotary_pct"]), raw


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_any_mix_of_spellings_describes_the_model_transformers_builds(raw):
    _check(raw)


@pytest.mark.heavy
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_any_mix_of_spellings_describes_the_model_transformers_builds_many(raw):
    _check(raw)


@pytest.mark.parametrize("raw", [
    {"model_type": "opt", "n_layer": 3, "hidden_size": 64, "num_attention_heads": 4, "ffn_dim": 96,
     "vocab_size": 200},  # OPT reads num_hidden_layers only: 12 layers
    {"model_type": "bloom", "num_layers": 3},  # BLOOM reads n_layer and num_hidden_layers: 2 layers
    {"model_type": "gpt_neox", "hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 96, "vocab_size": 200,
     "num_hidden_layers": 1, "rotary_pct": 0.25,
     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
    {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
     "intermediate_size": 96, "vocab_size": 200, "num_hidden_layers": 1},  # head_dim read through getattr
])
def test_the_published_mis_reads(raw):
    """The spellings the hand-written alias table read and transformers ignores (or the reverse)."""
    _check(raw)


def test_every_family_has_its_keys():
    assert set(KEYS) == set(FAMILIES) and all(set(keys) == set(SPELLINGS) for keys in KEYS.values())


@pytest.mark.heavy
def test_the_generated_table_is_current():
    render = runpy.run_path(str(ROOT / "scripts" / "gen_config_keys.py"), run_name="gen")["render"]
    assert render() == (ROOT / "llmem" / "config_keys.py").read_text()
