"""The LayerNorm decoders' parameter tensors (GPT-2, OPT, GPT-NeoX, Falcon, BLOOM), as transformers 5.23.0 creates
them (`models/<type>/modeling_<type>.py`); the table that names them is `llmem.families.FAMILIES`."""

from __future__ import annotations

from llmem.family import REP, Config, _linear, _norm
from llmem.spec import ModelSpec

# --- GPT-2 -------------------------------------------------------------------------------------------------------


def _gpt2_layer(c: Config, s: ModelSpec, i: int) -> list:
    p, h, inner = f"transformer.h.{i}", s.hidden_size, s.intermediate_size

    def conv1d(name, inp, out):  # transformers Conv1D stores the weight as (in, out)
        return [(f"{name}.weight", (inp, out), REP), (f"{name}.bias", (out,), REP)]

    return (
        _norm(f"{p}.ln_1", h, True)
        + conv1d(f"{p}.attn.c_attn", h, 3 * h)
        + conv1d(f"{p}.attn.c_proj", h, h)
        + _norm(f"{p}.ln_2", h, True)
        + conv1d(f"{p}.mlp.c_fc", h, inner)
        + conv1d(f"{p}.mlp.c_proj", inner, h)
    )


def _gpt2_outer(c: Config, s: ModelSpec) -> list:
    items = [
        ("transformer.wte.weight", (s.vocab_size, s.hidden_size), REP),
        ("transformer.wpe.weight", (c.int("n_positions"), s.hidden_size), REP),
    ]
    items += _norm("transformer.ln_f", s.hidden_size, True)
    if not s.tie_word_embeddings:
        items.append(("lm_head.weight", (s.vocab_size, s.hidden_size), REP))
    return items


# --- OPT ---------------------------------------------------------------------------------------------------------


def _opt_layer(c: Config, s: ModelSpec, i: int) -> list:
    p, h = f"model.decoder.layers.{i}", s.hidden_size
    bias, affine = bool(c.get("enable_bias")), bool(c.get("layer_norm_elementwise_affine"))
    norm = (lambda n: _norm(n, h, True)) if affine else (lambda n: [])
    return (
        _linear(f"{p}.self_attn.k_proj", h, h, bias)
        + _linear(f"{p}.self_attn.v_proj", h, h, bias)
        + _linear(f"{p}.self_attn.q_proj", h, h, bias)
        + _linear(f"{p}.self_attn.out_proj", h, h, bias)
        + norm(f"{p}.self_attn_layer_norm")
        + _linear(f"{p}.fc1", s.intermediate_size, h, bias)
        + _linear(f"{p}.fc2", h, s.intermediate_size, bias)
        + norm(f"{p}.final_layer_norm")
    )


def _opt_outer(c: Config, s: ModelSpec) -> list:
    h, proj = s.hidden_size, c.opt_int("word_embed_proj_dim") or s.hidden_size
    items = [
        ("model.decoder.embed_tokens.weight", (s.vocab_size, proj), REP),
        # OPTLearnedPositionalEmbedding keeps an offset of 2 rows
        ("model.decoder.embed_positions.weight", (c.int("max_position_embeddings") + 2, h), REP),
    ]
    if c.get("do_layer_norm_before") and not c.get("_remove_final_layer_norm"):
        items += _norm("model.decoder.final_layer_norm", h, True) if c.get("layer_norm_elementwise_affine") else []
    if proj != h:
        items += [("model.decoder.project_out.weight", (proj, h), REP),
                  ("model.decoder.project_in.weight", (h, proj), REP)]
    if not s.tie_word_embeddings:
        items.append(("lm_head.weight", (s.vocab_size, proj), REP))
    return items


# --- GPT-NeoX (Pythia), Falcon, BLOOM ----------------------------------------------------------------------------


def _neox_layer(c: Config, s: ModelSpec, i: int) -> list:
    p, h, bias = f"gpt_neox.layers.{i}", s.hidden_size, bool(c.get("attention_bias"))
    return (
        _norm(f"{p}.input_layernorm", h, True)
        + _norm(f"{p}.post_attention_layernorm", h, True)
        + _linear(f"{p}.attention.query_key_value", 3 * h, h, bias)
        + _linear(f"{p}.attention.dense", h, h, bias)
        + _linear(f"{p}.mlp.dense_h_to_4h", s.intermediate_size, h, True)
        + _linear(f"{p}.mlp.dense_4h_to_h", h, s.intermediate_size, True)
    )


def _neox_outer(c: Config, s: ModelSpec) -> list:
    items = [("gpt_neox.embed_in.weight", (s.vocab_size, s.hidden_size), REP)]
    items += _norm("gpt_neox.final_layer_norm", s.hidden_size, True)
    if not s.tie_word_embeddings:
        items.append(("lm_head.weight", (s.vocab_size, s.hidden_size), REP))
    return items


def falcon_layernorms(c: Config) -> tuple[str, ...]:
    """transformers `FalconDecoderLayer.__init__`: which LayerNorms a layer has."""
    if not c.get("parallel_attn"):
        return ("post_attention_layernorm", "input_layernorm")
    n = c.get("num_ln_in_parallel_attn")
    if n is None and c.get("new_decoder_architecture"):
        n = 2
    return ("ln_attn", "ln_mlp") if n == 2 else ("input_layernorm",)


def _falcon_kv_heads(c: Config, heads: int, kv: int) -> int:
    """`FalconAttention`: the new architecture uses num_kv_heads; the old one is multi-query (1) or full (heads)."""
    if c.get("new_decoder_architecture"):
        return kv
    return 1 if c.get("multi_query") else heads


def _falcon_layer(c: Config, s: ModelSpec, i: int) -> list:
    p, h, bias = f"transformer.h.{i}", s.hidden_size, bool(c.get("bias"))
    if c.get("new_decoder_architecture"):
        qkv = (2 * s.num_kv_heads + s.num_heads) * s.head_dim
    elif c.get("multi_query"):
        qkv = h + 2 * s.head_dim
    else:
        qkv = 3 * h
    items = _linear(f"{p}.self_attention.query_key_value", qkv, h, bias)
    items += _linear(f"{p}.self_attention.dense", h, h, bias)
    items += _linear(f"{p}.mlp.dense_h_to_4h", s.intermediate_size, h, bias)
    items += _linear(f"{p}.mlp.dense_4h_to_h", h, s.intermediate_size, bias)
    for n in falcon_layernorms(c):
        items += _norm(f"{p}.{n}", h, True)
    return items


def _falcon_outer(c: Config, s: ModelSpec) -> list:
    items = [("transformer.word_embeddings.weight", (s.vocab_size, s.hidden_size), REP)]
    items += _norm("transformer.ln_f", s.hidden_size, True)
    if not s.tie_word_embeddings:
        items.append(("lm_head.weight", (s.vocab_size, s.hidden_size), REP))
    return items


def _bloom_layer(c: Config, s: ModelSpec, i: int) -> list:
    p, h = f"transformer.h.{i}", s.hidden_size
    return (
        _norm(f"{p}.input_layernorm", h, True)
        + _linear(f"{p}.self_attention.query_key_value", 3 * h, h, True)
        + _linear(f"{p}.self_attention.dense", h, h, True)
        + _norm(f"{p}.post_attention_layernorm", h, True)
        + _linear(f"{p}.mlp.dense_h_to_4h", 4 * h, h, True)
        + _linear(f"{p}.mlp.dense_4h_to_h", h, 4 * h, True)
    )


def _bloom_outer(c: Config, s: ModelSpec) -> list:
    items = [("transformer.word_embeddings.weight", (s.vocab_size, s.hidden_size), REP)]
    items += _norm("transformer.word_embeddings_layernorm", s.hidden_size, True)
    items += _norm("transformer.ln_f", s.hidden_size, True)
    if not s.tie_word_embeddings:
        items.append(("lm_head.weight", (s.vocab_size, s.hidden_size), REP))
    return items
