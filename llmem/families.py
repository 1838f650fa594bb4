"""The HF-config adapter: one `Family` per supported `model_type`.

Each family reads its config keys through an alias table with the defaults of its transformers configuration class
(transformers 5.23.0, `models/<type>/configuration_<type>.py`), and lists its parameter tensors exactly as the
transformers module creates them (`models/<type>/modeling_<type>.py`). A test compares every family with the real
model instantiated on the meta device, tensor by tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from llmem.errors import InputError
from llmem.spec import ModelSpec, ParamTensor, TpSplit

COL, ROW, REP = TpSplit.COLWISE, TpSplit.ROWWISE, TpSplit.NONE
MAX_DIM = 1 << 22  # no real model has a single dimension above ~4M; larger values are typos
MAX_COUNT = {"num_layers": 4096, "num_experts": 4096}  # bound the parameter inventory a config can ask for

# Canonical name -> config keys that may hold it, first match wins (transformers' attribute_map plus old spellings).
ALIASES = {
    "vocab_size": ("vocab_size", "padded_vocab_size"),
    "hidden_size": ("hidden_size", "n_embd", "n_embed", "d_model"),
    "intermediate_size": ("intermediate_size",),
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "num_heads": ("num_attention_heads", "n_head", "num_heads"),
    "num_kv_heads": ("num_key_value_heads", "num_kv_heads", "n_head_kv"),
    "head_dim": ("head_dim",),
    "tie_word_embeddings": ("tie_word_embeddings",),
    "num_experts": ("num_experts", "num_local_experts"),
    "n_positions": ("n_positions", "max_position_embeddings"),
}


class Config:
    """Read access to a config dict through the alias table, with a family's defaults; errors name the key."""

    def __init__(self, raw: dict, defaults: dict, aliases: dict):
        self.raw, self.defaults, self.aliases = raw, defaults, {**ALIASES, **aliases}

    def _lookup(self, name: str):
        for key in self.aliases.get(name, (name,)):
            if self.raw.get(key) is not None:
                return key, self.raw[key]
        return name, self.defaults.get(name)

    def int(self, name: str, minimum: int = 1) -> int:
        maximum = MAX_COUNT.get(name, MAX_DIM)
        key, value = self._lookup(name)
        if value is None:
            raise InputError(key, "missing from config.json and has no default for this model_type")
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or int(value) != value):
            raise InputError(key, f"must be a whole number, got {value!r}")
        if not minimum <= value <= maximum:
            raise InputError(key, f"must be between {minimum} and {maximum:,}, got {value}")
        return int(value)

    def opt_int(self, name: str, minimum: int = 1) -> int | None:
        return None if self._lookup(name)[1] is None else self.int(name, minimum)

    def bool(self, name: str) -> bool:
        key, value = self._lookup(name)
        if not isinstance(value, bool):
            raise InputError(key, f"must be true or false, got {value!r}")
        return value

    def get(self, name: str):
        return self._lookup(name)[1]


@dataclass(frozen=True)
class Family:
    """What llmem needs to know about one architecture."""

    model_type: str
    defaults: dict
    layer_params: Callable[[Config, ModelSpec, int], list]
    outer_params: Callable[[Config, ModelSpec], list]
    tp_plan: bool = False  # separate q/k/v/o and gate/up/down Linear layers: the Megatron plan of DESIGN.md applies
    norm: str = "rms"  # "rms" (RMSNorm) or "layer" (nn.LayerNorm)
    kv_heads: Callable[[Config, int, int], int] | None = None  # (config, heads, configured kv) -> kv heads in use
    extra: tuple[str, ...] = ()  # further config keys kept in ModelSpec.options for the activation model
    aliases: dict | None = None  # family-specific spellings, over ALIASES

    def build(self, raw: dict) -> ModelSpec:
        c = Config(raw, self.defaults, self.aliases or {})
        hidden = c.int("hidden_size")
        heads = c.int("num_heads")
        head_dim = c.opt_int("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise InputError("num_attention_heads", f"{heads} heads do not divide hidden_size {hidden}")
            head_dim = hidden // heads
        kv = c.opt_int("num_kv_heads") or heads
        if self.kv_heads is not None:
            kv = self.kv_heads(c, heads, kv)
        if heads % kv:
            raise InputError("num_key_value_heads", f"{kv} KV heads must divide the {heads} attention heads")
        experts = c.opt_int("num_experts", 0) or 0
        spec = ModelSpec(
            model_type=self.model_type,
            name=str(raw.get("_name_or_path") or raw.get("name_or_path") or self.model_type),
            vocab_size=c.int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=c.int("intermediate_size") if c.get("intermediate_size") is not None else 4 * hidden,
            num_layers=c.int("num_layers"),
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=head_dim,
            tie_word_embeddings=c.bool("tie_word_embeddings"),
            num_experts=experts,
            experts_per_token=c.int("num_experts_per_tok") if experts else 0,
            moe_intermediate_size=(c.opt_int("moe_intermediate_size") or 0) if experts else 0,
            shared_expert_intermediate_size=(c.opt_int("shared_expert_intermediate_size", 0) or 0) if experts else 0,
            options={k: c.get(k) for k in self.extra},
        )
        if spec.experts_per_token > max(experts, 1):
            raise InputError("num_experts_per_tok", f"{spec.experts_per_token} exceeds num_experts {experts}")
        params = []
        for i in range(spec.num_layers):
            params += [ParamTensor(n, tuple(s), i, t) for n, s, t in self.layer_params(c, spec, i)]
        params += [ParamTensor(n, tuple(s), None, t) for n, s, t in self.outer_params(c, spec)]
        object.__setattr__(spec, "params", tuple(params))
        return spec


def _linear(name: str, out: int, inp: int, bias: bool, split: TpSplit = REP) -> list:
    """An nn.Linear: weight (out, in) and optional bias (out); a row-wise split replicates the bias."""
    items = [(f"{name}.weight", (out, inp), split)]
    if bias:
        items.append((f"{name}.bias", (out,), COL if split is COL else REP))
    return items


def _norm(name: str, size: int, bias: bool) -> list:
    return [(f"{name}.weight", (size,), REP)] + ([(f"{name}.bias", (size,), REP)] if bias else [])


# --- Llama-like decoders: llama, mistral, qwen2, qwen3, gemma, gemma2, phi3, mixtral, qwen2_moe -----------------


def _llama_attention(p: str, s: ModelSpec, qkv_bias: bool, o_bias: bool) -> list:
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    return (
        _linear(f"{p}.q_proj", q, s.hidden_size, qkv_bias, COL)
        + _linear(f"{p}.k_proj", kv, s.hidden_size, qkv_bias, COL)
        + _linear(f"{p}.v_proj", kv, s.hidden_size, qkv_bias, COL)
        + _linear(f"{p}.o_proj", s.hidden_size, q, o_bias, ROW)
    )


def _gated_mlp(p: str, hidden: int, inter: int, bias: bool = False) -> list:
    return (
        _linear(f"{p}.gate_proj", inter, hidden, bias, COL)
        + _linear(f"{p}.up_proj", inter, hidden, bias, COL)
        + _linear(f"{p}.down_proj", hidden, inter, bias, ROW)
    )


def _llama_outer(c: Config, s: ModelSpec, prefix: str = "model") -> list:
    items = [(f"{prefix}.embed_tokens.weight", (s.vocab_size, s.hidden_size), REP)]
    items += _norm(f"{prefix}.norm", s.hidden_size, False)
    if not s.tie_word_embeddings:
        items.append(("lm_head.weight", (s.vocab_size, s.hidden_size), REP))
    return items


def _llama_layer(qkv_bias: Callable[[Config], bool], o_bias: Callable[[Config], bool] = lambda c: False,
                 qk_norm: bool = False, sandwich_norms: bool = False):
    def layer(c: Config, s: ModelSpec, i: int) -> list:
        p = f"model.layers.{i}"
        bias = bool(qkv_bias(c))
        items = _llama_attention(f"{p}.self_attn", s, bias, bool(o_bias(c)))
        if qk_norm:
            items += _norm(f"{p}.self_attn.q_norm", s.head_dim, False)
            items += _norm(f"{p}.self_attn.k_norm", s.head_dim, False)
        items += _gated_mlp(f"{p}.mlp", s.hidden_size, s.intermediate_size, bool(c.get("mlp_bias")))
        items += _norm(f"{p}.input_layernorm", s.hidden_size, False)
        items += _norm(f"{p}.post_attention_layernorm", s.hidden_size, False)
        if sandwich_norms:
            items += _norm(f"{p}.pre_feedforward_layernorm", s.hidden_size, False)
            items += _norm(f"{p}.post_feedforward_layernorm", s.hidden_size, False)
        return items

    return layer


def _phi3_layer(c: Config, s: ModelSpec, i: int) -> list:
    p = f"model.layers.{i}"
    qkv = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    return (
        _linear(f"{p}.self_attn.o_proj", s.hidden_size, s.num_heads * s.head_dim, False)
        + _linear(f"{p}.self_attn.qkv_proj", qkv, s.hidden_size, False)
        + _linear(f"{p}.mlp.gate_up_proj", 2 * s.intermediate_size, s.hidden_size, False)
        + _linear(f"{p}.mlp.down_proj", s.hidden_size, s.intermediate_size, False)
        + _norm(f"{p}.input_layernorm", s.hidden_size, False)
        + _norm(f"{p}.post_attention_layernorm", s.hidden_size, False)
    )


def _moe_experts(p: str, s: ModelSpec, inter: int) -> list:
    """Router plus experts stored as 3-D tensors (transformers 5 `MixtralExperts`)."""
    e, h = s.num_experts, s.hidden_size
    return (
        _linear(f"{p}.gate", e, h, False)
        + [(f"{p}.experts.gate_up_proj", (e, 2 * inter, h), REP), (f"{p}.experts.down_proj", (e, h, inter), REP)]
    )


def _mixtral_layer(c: Config, s: ModelSpec, i: int) -> list:
    p = f"model.layers.{i}"
    return (
        _llama_attention(f"{p}.self_attn", s, False, False)
        + _moe_experts(f"{p}.mlp", s, s.intermediate_size)
        + _norm(f"{p}.input_layernorm", s.hidden_size, False)
        + _norm(f"{p}.post_attention_layernorm", s.hidden_size, False)
    )


def qwen2_moe_is_sparse(c: Config, s: ModelSpec, i: int) -> bool:
    """transformers `Qwen2MoeDecoderLayer`: sparse unless listed in mlp_only_layers or off the sparse step."""
    step = c.int("decoder_sparse_step")
    dense = c.get("mlp_only_layers") or []
    if not isinstance(dense, list):
        raise InputError("mlp_only_layers", f"must be a list of layer indices, got {dense!r}")
    return i not in dense and s.num_experts > 0 and (i + 1) % step == 0


def _qwen2_moe_layer(c: Config, s: ModelSpec, i: int) -> list:
    p = f"model.layers.{i}"
    items = _llama_attention(f"{p}.self_attn", s, bool(c.get("qkv_bias")), False)
    if qwen2_moe_is_sparse(c, s, i):
        items += _moe_experts(f"{p}.mlp", s, s.moe_intermediate_size)
        items += _gated_mlp(f"{p}.mlp.shared_expert", s.hidden_size, s.shared_expert_intermediate_size)
        items += _linear(f"{p}.mlp.shared_expert_gate", 1, s.hidden_size, False)
    else:
        items += _gated_mlp(f"{p}.mlp", s.hidden_size, s.intermediate_size)
    items += _norm(f"{p}.input_layernorm", s.hidden_size, False)
    items += _norm(f"{p}.post_attention_layernorm", s.hidden_size, False)
    return items


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


# --- The table -----------------------------------------------------------------------------------------------------

_DROP = ("attention_dropout",)  # eager attention's dropout on the probabilities (transformers default 0.0)
_LLAMA_BASE = dict(tie_word_embeddings=False, num_kv_heads=None, head_dim=None, attention_bias=False, mlp_bias=False)

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in [
        Family("llama", {**_LLAMA_BASE, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                         "num_layers": 32, "num_heads": 32},
               _llama_layer(lambda c: c.get("attention_bias"), lambda c: c.get("attention_bias")), _llama_outer,
               tp_plan=True, extra=_DROP),
        Family("mistral", {**_LLAMA_BASE, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                           "num_layers": 32, "num_heads": 32, "num_kv_heads": 8},
               _llama_layer(lambda c: False), _llama_outer, tp_plan=True, extra=_DROP),
        Family("qwen2", {**_LLAMA_BASE, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
                         "num_layers": 32, "num_heads": 32},
               _llama_layer(lambda c: True), _llama_outer, tp_plan=True, extra=_DROP),
        Family("qwen3", {**_LLAMA_BASE, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
                         "num_layers": 32, "num_heads": 32, "head_dim": 128},
               _llama_layer(lambda c: c.get("attention_bias"), lambda c: c.get("attention_bias"), qk_norm=True),
               _llama_outer, tp_plan=True, extra=_DROP),
        Family("gemma", {**_LLAMA_BASE, "vocab_size": 256000, "hidden_size": 3072, "intermediate_size": 24576,
                         "num_layers": 28, "num_heads": 16, "head_dim": 256, "tie_word_embeddings": True},
               _llama_layer(lambda c: c.get("attention_bias"), lambda c: c.get("attention_bias")), _llama_outer,
               tp_plan=True, extra=_DROP),
        Family("gemma2", {**_LLAMA_BASE, "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216,
                          "num_layers": 26, "num_heads": 8, "num_kv_heads": 4, "head_dim": 256,
                          "tie_word_embeddings": True, "attn_logit_softcapping": 50.0,
                          "final_logit_softcapping": 30.0},
               _llama_layer(lambda c: c.get("attention_bias"), lambda c: c.get("attention_bias"),
                            sandwich_norms=True), _llama_outer, tp_plan=True,
               extra=(*_DROP, "attn_logit_softcapping", "final_logit_softcapping")),
        Family("phi3", {**_LLAMA_BASE, "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
                        "num_layers": 32, "num_heads": 32, "resid_pdrop": 0.0, "embd_pdrop": 0.0},
               _phi3_layer, _llama_outer, extra=(*_DROP, "resid_pdrop", "embd_pdrop")),
        Family("mixtral", {**_LLAMA_BASE, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                           "num_layers": 32, "num_heads": 32, "num_kv_heads": 8, "num_experts": 8,
                           "num_experts_per_tok": 2},
               _mixtral_layer, _llama_outer, extra=_DROP),
        Family("qwen2_moe", {**_LLAMA_BASE, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
                             "num_layers": 24, "num_heads": 16, "num_experts": 60, "num_experts_per_tok": 4,
                             "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                             "decoder_sparse_step": 1, "mlp_only_layers": [], "qkv_bias": True},
               _qwen2_moe_layer, _llama_outer, extra=("norm_topk_prob", *_DROP)),
        Family("gpt2", {"vocab_size": 50257, "hidden_size": 768, "intermediate_size": None, "num_layers": 12,
                        "num_heads": 12, "tie_word_embeddings": True, "n_positions": 1024, "resid_pdrop": 0.1,
                        "embd_pdrop": 0.1, "attn_pdrop": 0.1},
               _gpt2_layer, _gpt2_outer, norm="layer", aliases={"intermediate_size": ("n_inner",)},
               extra=("resid_pdrop", "embd_pdrop", "attn_pdrop")),
        Family("opt", {"vocab_size": 50272, "hidden_size": 768, "intermediate_size": 3072, "num_layers": 12,
                       "num_heads": 12, "tie_word_embeddings": True, "max_position_embeddings": 2048,
                       "word_embed_proj_dim": None, "do_layer_norm_before": True, "enable_bias": True,
                       "_remove_final_layer_norm": False, "layer_norm_elementwise_affine": True, "dropout": 0.1,
                       "attention_dropout": 0.0},
               _opt_layer, _opt_outer, norm="layer", aliases={"intermediate_size": ("ffn_dim",)},
               extra=("dropout", "attention_dropout")),
        Family("gpt_neox", {"vocab_size": 50432, "hidden_size": 6144, "intermediate_size": 24576, "num_layers": 44,
                            "num_heads": 64, "tie_word_embeddings": False, "attention_bias": True,
                            "rotary_pct": 0.25, "attention_dropout": 0.0, "hidden_dropout": 0.0},
               _neox_layer, _neox_outer, norm="layer",
               extra=("use_parallel_residual", "rotary_pct", "attention_dropout", "hidden_dropout"),
               aliases={"rotary_pct": ("rotary_pct", "partial_rotary_factor")}),
        Family("falcon", {"vocab_size": 65024, "hidden_size": 4544, "num_layers": 32, "num_heads": 71,
                          "num_kv_heads": None, "tie_word_embeddings": True, "new_decoder_architecture": False,
                          "multi_query": True, "parallel_attn": True, "bias": False, "num_ln_in_parallel_attn": None},
               _falcon_layer, _falcon_outer, norm="layer", kv_heads=_falcon_kv_heads,
               extra=("new_decoder_architecture", "parallel_attn", "attention_dropout", "hidden_dropout"),
               aliases={"intermediate_size": ("ffn_hidden_size",)}),
        Family("bloom", {"vocab_size": 250880, "hidden_size": 64, "num_layers": 2, "num_heads": 8,
                         "tie_word_embeddings": True},
               _bloom_layer, _bloom_outer, norm="layer", aliases={"intermediate_size": ()},
               extra=("attention_dropout", "hidden_dropout")),
    ]
}
