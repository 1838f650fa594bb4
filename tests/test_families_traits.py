"""Every `Family` trait against what transformers' modeling code does for a small config built from its config
class (the model instantiated on the meta device, its modules and their source read)."""

import inspect

import pytest

from llmem.components import fused_ce
from llmem.families import FAMILIES, with_trait
from llmem.runtime.parallel import tp_layer_plan
from llmem.spec import ModelSpec, attention_implementation

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=100, pad_token_id=0, bos_token_id=0, eos_token_id=0)
EXTRA = {"gemma": {"head_dim": 16}, "gemma2": {"head_dim": 16}, "gpt2": dict(n_embd=64, n_layer=2, n_head=4),
         "opt": dict(ffn_dim=96), "bloom": dict(n_layer=2, n_head=4), "mixtral": dict(num_local_experts=4),
         "qwen2_moe": dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48)}


def _build(model_type: str):
    cfg = transformers.AutoConfig.for_model(model_type, **{**TINY, **EXTRA.get(model_type, {})})
    cfg._attn_implementation = "eager"
    with torch.device("meta"):
        return cfg, transformers.AutoModelForCausalLM.from_config(cfg)


def _source(obj) -> str:
    return inspect.getsource(type(obj) if not inspect.isclass(obj) else obj)


def _activation(model, cfg) -> str:
    names = {type(m).__name__ for m in model.modules()}
    if "BloomGelu" in names:
        return "bloom-gelu"
    if "NewGELUActivation" in names:
        return "gelu-new"
    layer_names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    if {"gate_proj", "gate_up_proj"} & layer_names or any("Experts" in n for n in names):
        return "gated"
    return cfg.to_dict().get("hidden_act") or cfg.to_dict().get("activation_function") or cfg.activation


def observed(model_type: str) -> dict:
    """Each trait as the transformers model shows it."""
    cfg, model = _build(model_type)
    modules = dict(model.named_modules())
    short = {n.rsplit(".", 1)[-1] for n in modules}
    kinds = {type(m).__name__: m for m in modules.values()}
    rotary = next((m for name, m in kinds.items() if name.endswith("RotaryEmbedding")), None)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    layer0 = next(m for n, m in modules.items() if n.endswith(("layers.0", "h.0")))
    attention = next(m for n, m in layer0.named_children() if "attn" in n or "attention" in n)
    router = next((m for name, m in kinds.items() if name.endswith("TopKRouter")), None)
    norm = next((m for name, m in kinds.items() if name.endswith("RMSNorm")), None)
    in_layer = dict(layer0.named_modules())
    return {
        "rope": rotary is not None,
        "partial_rotary": rotary is not None and rotary.inv_freq.numel() * 2 < head_dim,
        "sdpa": type(model)._supports_sdpa,
        "own_attention_core": "scaled_dot_product_attention(" in _source(attention),
        "sliding_window_layers": len(set(getattr(cfg, "layer_types", None) or [])) > 1,
        "unit_offset_norm": norm is not None and "1.0 + self.weight.float()" in _source(norm),
        "sandwich_norms": "post_feedforward_layernorm" in short,
        "scaled_embeddings": any(name.endswith("ScaledWordEmbedding") for name in kinds),
        "embed_projection": any(hasattr(m, "project_in") for m in modules.values()),
        "conv1d": "Conv1D" in kinds,
        "transposed_weight_matmul": any("self.weight.T" in _source(type(m)) for n, m in in_layer.items()
                                        if isinstance(m, torch.nn.Linear) and type(m) is not torch.nn.Linear),
        "mlp_activation": _activation(model, cfg),
        "grouped_experts": any(name.endswith("Experts") for name in kinds),
        "routing_weights_fp32": router is not None and ".to(router_logits.dtype)" not in _source(router),
        "topk_renormalized": router is not None and "/=" in _source(router) and "norm_topk_prob" not in _source(
            router),
        "shared_expert": "shared_expert" in short,
        "learned_positions": next((n.rsplit(".", 1)[-1] for n, m in modules.items()
                                   if n.rsplit(".", 1)[-1] in ("wpe", "embed_positions")
                                   and isinstance(m, torch.nn.Embedding)), ""),
        "batched_position_ids": any("cumsum(attention_mask" in _source(m) for name, m in kinds.items()
                                    if name.endswith("PositionalEmbedding")),
        "embedding_norm": "word_embeddings_layernorm" in short,
        "qk_norm": {"q_norm", "k_norm"} <= short,
        "fused_projections": {"qkv_proj", "gate_up_proj"} <= short,
        "has_embedding_dropout": any(isinstance(m, torch.nn.Dropout) for m in model.base_model.children()),
        "residual_dropout": "resid_attn_dropout" in short,
        "tp_plan": all(isinstance(in_layer.get(n), torch.nn.Linear) for n in tp_layer_plan()),
        "passes_position_ids": "position_ids" in inspect.signature(type(layer0).forward).parameters,
        "attention_adds_residual": "residual" in inspect.signature(type(attention).forward).parameters,
        "parallel_residual_sum": "mlp_output + attn_output + hidden_states" in _source(layer0),
        "forward_source": _source(model.base_model) + _source(getattr(model.base_model, "decoder", model.base_model)),
    }


OBSERVED = {}


def _observed(model_type: str) -> dict:
    if model_type not in OBSERVED:
        OBSERVED[model_type] = observed(model_type)
    return OBSERVED[model_type]


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_traits_match_the_transformers_model(model_type):
    family, seen = FAMILIES[model_type], _observed(model_type)
    for trait, value in seen.items():
        if trait not in ("passes_position_ids", "has_embedding_dropout", "forward_source"):
            assert getattr(family, trait) == value, trait
    assert family.norm == ("rms" if any(k.endswith("RMSNorm") for k in map(lambda m: type(m).__name__,
                                                                               _build(model_type)[1].modules()))
                           else "layer")


def test_position_ids_held_where_the_model_passes_them_to_its_layers():
    """The trait implies the fact. OPT's layers take position_ids too, which its learned position embedding saves
    anyway (`activations.outer_saved`); GPT-NeoX and Falcon pass them to their layers as well but are not modelled
    holding them (`Family.position_ids_held`): the day they are, this test says so."""
    passing = {mt for mt in FAMILIES if _observed(mt)["passes_position_ids"]}
    assert set(with_trait("position_ids_held")) <= passing
    assert passing - set(with_trait("position_ids_held")) == {"opt", "gpt_neox", "falcon"}


def test_lora_table_covers_the_plain_llama_layer():
    """The LoRA activation table is written for llama's layer: separate projections, no sandwich norms, no per-head
    q/k norms beyond qwen3's (which the table has); and its grouped-experts MoE variants, their MoE block frozen."""
    plain = {mt for mt, f in FAMILIES.items() if (f.tp_plan or f.grouped_experts) and not f.sandwich_norms}
    assert set(with_trait("lora_activations")) == plain


def test_liger_listing_is_the_trait():
    assert set(fused_ce.LIGER_LISTED) == set(with_trait("liger_kernel"))


def test_liger_kernel_has_a_patch_exactly_for_the_trait():
    monkey_patch = pytest.importorskip("liger_kernel.transformers.monkey_patch")
    for model_type, family in FAMILIES.items():
        assert hasattr(monkey_patch, f"apply_liger_kernel_to_{model_type}") == family.liger_kernel, model_type


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_attention_implementation_follows_the_sdpa_trait(model_type):
    expected = "sdpa" if FAMILIES[model_type].sdpa else "eager"
    assert attention_implementation(model_type, "sdpa") == expected
    assert attention_implementation(model_type, "eager") == "eager"


def test_a_derived_architecture_gets_coverage_traits_off_and_rope_from_its_config():
    config = {"model_type": "stablelm", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "vocab_size": 100}
    family = ModelSpec.from_config(config).family
    assert not (family.tp_plan or family.liger_kernel or family.lora_activations or family.conv1d)
    assert family.rope == (transformers.AutoConfig.for_model(**config).to_dict().get("rope_theta") is not None
                           or "rope_theta" in config or "rope_parameters" in config)
    assert attention_implementation("stablelm", "sdpa") == "sdpa"


def test_embedding_dropout_where_the_model_has_one():
    """Phi3Model has no embedding dropout in transformers 5.23 (embd_pdrop is a config key nothing reads) but the
    table keeps one for it (nothing is saved at the default 0): the test names it until the table follows."""
    modelled = set(with_trait("embedding_dropout"))
    present = {mt for mt in FAMILIES if _observed(mt)["has_embedding_dropout"]}
    assert present <= modelled and modelled - present == {"phi3"}
    for model_type in modelled:
        assert FAMILIES[model_type].embedding_dropout[1] in transformers.AutoConfig.for_model(model_type).to_dict()


LOCALS_MADE = {  # `Family.forward_locals` -> what the model forward's source makes it with (transformers 5.23.0)
    "inputs_embeds": r"inputs_embeds = self\.", "position_embeds": r"pos(ition)?_embeds = self\.",
    "position_ids": r"position_ids = ", "position_attention_mask": r"position_attention_mask = torch\.ones\(",
    "alibi": r"alibi = ", "eager_mask": r"create_causal_mask\(",
}


@pytest.mark.parametrize("model_type", sorted(with_trait("forward_locals")))
def test_forward_locals_are_made_by_the_model_forward(model_type):
    """Each local a family lists is made in its model (or decoder) forward; the undropped embeddings are the input
    of the embedding dropout module."""
    import re

    family, source = FAMILIES[model_type], _observed(model_type)["forward_source"]
    for local in family.forward_locals:
        if local == "undropped_embeds":
            assert f"self.{family.embedding_dropout[0]}(inputs_embeds)" in source
        else:
            assert re.search(LOCALS_MADE[local], source), local


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_window_layers_follow_the_config_class(model_type):
    """`Family.window_layers` is how the config class completes layer_types from use_sliding_window and
    max_window_layers (4 layers, max_window_layers 2)."""
    cfg = transformers.AutoConfig.for_model(model_type, num_hidden_layers=4, use_sliding_window=True,
                                            max_window_layers=2, sliding_window=16)
    kinds = ["s" if t == "sliding_attention" else "f" for t in (getattr(cfg, "layer_types", None) or [])]
    seen = {"ffss": "from-max", "sfff": "even-below-max"}.get("".join(kinds), "")
    assert FAMILIES[model_type].window_layers == seen


def _returned_probabilities(model_type: str, autocast: bool = False) -> tuple[list, object]:
    """The batch x heads x seq x seq tensors the model's decoder layer 0 returns with its output under eager
    attention (a real forward of a small model on the CPU, a hook on layer 0), under bf16 autocast if asked; and
    the model."""
    cfg = transformers.AutoConfig.for_model(model_type, **{**TINY, **EXTRA.get(model_type, {})})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    layers = next(m for m in model.base_model.modules() if isinstance(m, torch.nn.ModuleList))
    seen = []
    layers[0].register_forward_hook(lambda module, args, out: seen.append(out))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(input_ids=torch.zeros(2, 8, dtype=torch.long))
    outs = seen[0] if isinstance(seen[0], tuple) else (seen[0],)
    return [t for t in outs if isinstance(t, torch.Tensor) and t.dim() == 4 and tuple(t.shape[-2:]) == (8, 8)], model


def _layer_returns_kept_probabilities(model_type: str) -> bool:
    """Whether the layer returns its probabilities (`_returned_probabilities`) and the model's forward binds the
    layer's whole return to a name of its own (`outputs = block(...)`), which keeps it until the next layer returns."""
    import re

    probs, model = _returned_probabilities(model_type)
    bound = re.findall(r"\n\s+(\w+) = \w+\(\s*hidden_states", inspect.getsource(type(model.base_model).forward))
    return bool(probs) and any(name != "hidden_states" for name in bound)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_returned_probabilities_trait_matches_a_real_forward(model_type):
    assert FAMILIES[model_type].returns_attention_probs == _layer_returns_kept_probabilities(model_type)


@pytest.mark.parametrize("trait", ["pipeline_stages", "float8_linears", "request_stream"])
def test_llama_layer_coverage_only_on_llama_layers(trait):
    """The pipeline stage, the float8 moment and the request stream write out llama's dense decoder layer (separate
    q/k/v/o and gate/up/down nn.Linears, two RMS pre-norms): a family marked for them must have that layer."""
    for model_type in with_trait(trait):
        family = FAMILIES[model_type]
        assert family.tp_plan and family.norm == "rms" and family.mlp_activation == "gated", model_type
        assert not (family.sandwich_norms or family.grouped_experts or family.fused_projections), model_type


def test_context_parallel_coverage_needs_sdpa():
    """torch's ring attention replaces SDPA's kernels (`--cp` runs under --attn sdpa): a family marked for it must
    run transformers' SDPA path."""
    assert all(FAMILIES[t].sdpa and not FAMILIES[t].own_attention_core for t in with_trait("context_parallel"))


@pytest.mark.parametrize("model_type", sorted(with_trait("returns_attention_probs")))
def test_returned_probabilities_dtype_matches_a_real_forward(model_type):
    """Under bf16 autocast the residual stream is fp32 and the compute dtype bf16: the returned probabilities' dtype
    tells which `Family.returned_probs_dtype` is."""
    (probs,), _ = _returned_probabilities(model_type, autocast=True)
    assert FAMILIES[model_type].returned_probs_dtype == ("compute" if probs.dtype == torch.bfloat16 else "residual")
