"""ModelSpec: the closed-form parameter inventory against the real transformers model on the meta device."""

import pytest

from llmem.errors import InputError
from llmem.families import FAMILIES
from llmem.spec import ModelSpec

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=100, pad_token_id=0, bos_token_id=0, eos_token_id=0)

# Each family with its defaults, and with the switches that change which tensors exist.
CASES = [
    ("llama", {}), ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}),
    ("mistral", {}), ("qwen2", {}), ("qwen3", {}), ("qwen3", {"head_dim": 8, "attention_bias": True}),
    ("gemma", {"head_dim": 16}), ("gemma2", {"head_dim": 16}), ("phi3", {}),
    ("gpt2", dict(n_embd=64, n_layer=2, n_head=4, n_positions=32)),
    ("gpt2", dict(n_embd=64, n_layer=2, n_head=4, n_positions=32, n_inner=80, tie_word_embeddings=False)),
    ("opt", dict(ffn_dim=96, word_embed_proj_dim=32, max_position_embeddings=32, do_layer_norm_before=False)),
    ("opt", dict(ffn_dim=96, max_position_embeddings=32, enable_bias=False, layer_norm_elementwise_affine=False)),
    ("gpt_neox", dict(max_position_embeddings=32)), ("gpt_neox", dict(attention_bias=False, tie_word_embeddings=True)),
    ("falcon", {}), ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2, bias=True)),
    ("falcon", dict(multi_query=False, parallel_attn=False, tie_word_embeddings=False)),
    ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1)),
    ("bloom", dict(n_layer=2, n_head=4, hidden_size=64)),
    ("mixtral", dict(num_local_experts=4)),
    ("qwen2_moe", dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                       decoder_sparse_step=2, mlp_only_layers=[1])),
]


def meta_shapes(config: dict) -> dict:
    cfg = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def test_every_family_is_covered_by_a_case():
    assert {mt for mt, _ in CASES} == set(FAMILIES)


@pytest.mark.parametrize("model_type,extra", CASES, ids=[f"{mt}-{i}" for i, (mt, _) in enumerate(CASES)])
def test_parameter_inventory_matches_meta_model_tensor_by_tensor(model_type, extra):
    config = {**TINY, **extra, "model_type": model_type}
    spec = ModelSpec.from_config(config)
    expected = meta_shapes(config)
    assert {p.name: p.shape for p in spec.params} == expected
    assert spec.total_params == sum(torch.Size(s).numel() for s in expected.values())


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_defaults_follow_the_transformers_config_class(model_type):
    """A config naming only its model_type gets transformers' own defaults (the full-size default model)."""
    ours = ModelSpec.from_config({"model_type": model_type})
    theirs = transformers.AutoConfig.for_model(model_type)
    assert ours.num_layers == theirs.num_hidden_layers
    assert ours.hidden_size == theirs.hidden_size
    assert ours.vocab_size == theirs.vocab_size
    assert ours.tie_word_embeddings == theirs.tie_word_embeddings


# Published totals (model cards / safetensors index metadata) of real configs, key fields only.
LLAMA31_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)
MISTRAL_7B_V03 = dict(model_type="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8)


@pytest.mark.parametrize("config,published", [(LLAMA31_8B, 8_030_261_248), (MISTRAL_7B_V03, 7_248_023_552)])
def test_published_counts(config, published):
    assert ModelSpec.from_config(config).total_params == published


@pytest.mark.parametrize(
    "config,field",
    [
        ({}, "model_type"),
        ({"model_type": "llama", "hidden_size": -1}, "hidden_size"),
        ({"model_type": "llama", "hidden_size": "big"}, "hidden_size"),
        ({"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 5}, "num_attention_heads"),
        ({"model_type": "llama", "num_key_value_heads": 3}, "num_key_value_heads"),
        ({"model_type": "llama", "tie_word_embeddings": "yes"}, "tie_word_embeddings"),
        ({"model_type": "t5"}, "model_type"),
        ({"model_type": "mixtral", "num_experts_per_tok": 9}, "num_experts_per_tok"),
    ],
)
def test_bad_configs_name_the_field(config, field):
    with pytest.raises(InputError) as e:
        ModelSpec.from_config(config)
    assert e.value.field == field


def test_malformed_json_text():
    with pytest.raises(InputError, match="JSON"):
        ModelSpec.from_config('{"model_type": "llama",')


def test_unknown_architecture_falls_back_to_the_meta_device_with_a_caveat():
    config = {"model_type": "stablelm", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
              "num_attention_heads": 4, "vocab_size": 1000}
    spec = ModelSpec.from_config(config)
    expected = meta_shapes({**config, "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0})
    assert {p.name: p.shape for p in spec.params} == expected
    assert {p.layer for p in spec.params} == {0, 1, None}
    assert spec.caveats and "stablelm" in spec.caveats[0]


@pytest.mark.parametrize("config", [{"model_type": "t5"}, {"model_type": "no-such-arch"},
                                    {"model_type": "custom_llama", "auto_map": {"AutoModelForCausalLM": "x.Y"}},
                                    {"model_type": "stablelm", "num_hidden_layers": 10**7}])
def test_unbuildable_architectures_are_input_errors(config):
    with pytest.raises(InputError):
        ModelSpec.from_config(config)


@pytest.mark.parametrize("config", [
    {"model_type": "gptj", "n_head": 0},  # ZeroDivisionError inside the model's constructor
    {"model_type": "gptj", "n_embd": -5},  # negative dimension
    {"model_type": "llama4_text", "num_attention_heads": None},  # strict config validation
    {"model_type": "llama4", "text_config": {"model_type": "llama4_text", "num_attention_heads": None}},
])
def test_bad_sizes_on_the_meta_device_are_input_errors(config):
    with pytest.raises(InputError):
        ModelSpec.from_config(config)


def test_a_meta_device_spec_gets_derived_tables_and_refuses_what_they_do_not_cover():
    """Outside the families the activations are traced (`llmem.derive`); tensor parallelism without the config's
    plan and an 8-bit base under FSDP2 are refused naming their field."""
    from llmem import TrainingPlan
    from llmem.estimate import estimate

    config = {"model_type": "stablelm", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
              "num_attention_heads": 4, "vocab_size": 100}
    with pytest.raises(InputError) as e:  # stablelm's default 32 key/value heads: the forward fails
        estimate(ModelSpec.from_config(config), TrainingPlan(seq_len=64))
    assert e.value.field == "model_type" and "forward fails" in str(e.value)
    spec = ModelSpec.from_config({**config, "num_key_value_heads": 4})
    assert spec.derived is not None and estimate(spec, TrainingPlan(seq_len=64)).peak_bytes > 0
    qlora = dict(method="qlora", quant="int8", precision="bf16", gpus=2, zero=3)  # FSDP2 drops CB/SCB
    for fields, field in ((dict(gpus=2, tp=2), "tp"), (qlora, "quant")):
        with pytest.raises(InputError) as e:
            estimate(spec, TrainingPlan(**fields))
        assert e.value.field == field


def test_from_config_text_bounds_nesting_and_integers():
    with pytest.raises(InputError, match="nested"):
        ModelSpec.from_config('{"model_type": "llama", "x": ' + "[" * 5000 + "]" * 5000 + "}")
    with pytest.raises(InputError, match="digits"):
        ModelSpec.from_config('{"model_type": "llama", "hidden_size": ' + "9" * 5000 + "}")
    with pytest.raises(InputError, match="UTF-8"):
        ModelSpec.from_config(b"\xff\xfe{")
