"""The HF-config adapter's machinery: `Config` (read access with a family's defaults) and `Family`
(a `model_type`'s layer and outer tensor lists); the families themselves are in `llmem.families`.

Each family reads each size from the config.json keys its modeling code reads (`llmem.config_keys`, generated from
the models transformers builds), with the defaults of its configuration class (transformers 5.23.0,
`models/<type>/configuration_<type>.py`), and lists its parameter tensors exactly as the
transformers module creates them (`models/<type>/modeling_<type>.py`). A test compares every family with the real
model instantiated on the meta device, tensor by tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from llmem.config_keys import KEYS
from llmem.errors import InputError
from llmem.spec import ModelSpec, ParamTensor, TpSplit

COL, ROW, REP = TpSplit.COLWISE, TpSplit.ROWWISE, TpSplit.NONE
MAX_DIM = 1 << 22  # no real model has a single dimension above ~4M; larger values are typos
MAX_COUNT = {"num_layers": 4096, "num_experts": 4096}  # bound the parameter inventory a config can ask for



class Config:
    """Read access to a config dict through the keys the family's modeling code reads for each name
    (`llmem.config_keys.KEYS`, generated from the models transformers builds; dotted keys inside a dict), with the
    family's defaults; errors name the key."""

    def __init__(self, raw: dict, defaults: dict, keys: dict):
        self.raw, self.defaults, self.keys = raw, defaults, keys

    def _lookup(self, name: str):
        for key in self.keys.get(name, (name,)):
            head, _, leaf = key.partition(".")
            value = self.raw.get(head)
            if leaf:
                value = value.get(leaf) if isinstance(value, dict) else None
            if value is not None:
                return key, value
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
    # --- Architectural traits the generic code reads (transformers 5.23.0 `models/<type>/modeling_<type>.py`) ----
    # Positions and attention:
    rope: bool = False  # the model forward computes RoPE cos/sin once (`<Type>RotaryEmbedding`), kept for backward
    partial_rotary: bool = False  # RoPE rotates `rotary_pct` of head_dim only (`GPTNeoXRotaryEmbedding`)
    position_ids_held: bool = False  # a checkpointed decoder layer keeps the model forward's `position_ids`
    #   (`cache_position.unsqueeze(0)`, passed to every layer: `LlamaModel.forward` and the models built on it).
    #   GPTNeoXModel and FalconModel pass it to their layers too but are not modelled holding it (to measure)
    sdpa: bool = True  # `_supports_sdpa`: False when transformers refuses attn_implementation="sdpa" (the model
    #   runs its own eager attention for `--attn sdpa`: gemma2's softcapping, bloom's ALiBi)
    own_attention_core: bool = False  # the attention module computes its core itself (`FalconAttention`: sdpa with
    #   an explicit mask, or its own matmul-softmax), not through `eager_attention_forward`/the attention interface
    returns_attention_probs: bool = False  # the decoder layer returns its eager attention probabilities and the
    #   model's loop keeps them until the next layer returns (`FalconDecoderLayer.forward`: `return output,
    #   attn_weights`; `FalconModel.forward`: `outputs = block(...)`; BLOOM's alike): under checkpointing nothing
    #   saves them, so they sit beside the next layer's forward (`components.returned_probs`)
    returned_probs_dtype: str = "residual"  # their dtype: "residual" the residual stream's (falcon's
    #   `softmax(..., dtype=hidden_states.dtype)`, its layernorm output's), "compute" the compute dtype (BLOOM's
    #   `.to(query_layer.dtype)` after its fp32 softmax, `modeling_bloom.py` `BloomAttention.forward`)
    sliding_window_layers: bool = False  # even layers attend in a sliding window, odd ones fully
    #   (`Gemma2Config.layer_types`): the model builds both masks (`causal_mask_mapping`)
    window_layers: str = ""  # with `use_sliding_window`, which layers the config class makes sliding when the config
    #   has no layer_types: "from-max" the layers >= max_window_layers (`Qwen2Config.__post_init__`,
    #   `configuration_qwen2.py:84-93`; qwen3 the same, 87-94), "even-below-max" the even ones below it
    #   (`configuration_qwen2_moe.py:113-119`)
    sliding_window_default: int | None = None  # the config class's `sliding_window` default, for a config without
    #   one (`MistralConfig`: 4096, `configuration_mistral.py:80`): its layers attend in that window
    both_masks: bool = False  # the model forward builds the full and the sliding-window causal masks whatever the
    #   layers use (`Qwen2MoeModel.forward`'s `causal_mask_mapping`)
    # Norms and embeddings:
    unit_offset_norm: bool = False  # RMSNorm scales by (1 + weight) in fp32 (`GemmaRMSNorm`: x.float() normalized
    #   * (1.0 + self.weight.float()))
    sandwich_norms: bool = False  # norms after the attention and the MLP too (`Gemma2DecoderLayer`:
    #   post_attention_layernorm on o_proj's output, pre_/post_feedforward_layernorm around the MLP)
    scaled_embeddings: bool = False  # embeddings times a √hidden scalar tensor (`GemmaScaledWordEmbedding`)
    learned_positions: str = ""  # the learned position embedding whose position ids are saved: "wpe" (GPT-2) or
    #   "embed_positions" (OPT's `OPTLearnedPositionalEmbedding`)
    batched_position_ids: bool = False  # those ids are per sequence (batch × seq, OPT: from the attention mask's
    #   cumsum), not one row for the batch (1 × seq, GPT-2's `position_ids`)
    embedding_dropout: tuple[str, str] = ()  # (module, config key) of a dropout on the embeddings' output
    #   (GPT-2's `drop`, embd_pdrop; GPT-NeoX's `emb_dropout`, hidden_dropout)
    embedding_norm: bool = False  # a LayerNorm on the embeddings' output (`BloomModel.word_embeddings_layernorm`)
    output_layer: str = "lm_head"  # the `*ForCausalLM` output Linear's module name (what `get_output_embeddings()`
    #   returns), a module of its own even when tied: `lm_head` in every family here, GPT-NeoX included
    #   (`modeling_gpt_neox.py:385`; its checkpoints' `embed_out.` is renamed on load, `conversion_mapping.py:357`)
    embed_projection: bool = False  # project_in/project_out around the decoder when word_embed_proj_dim differs
    #   from hidden_size (`OPTDecoder`)
    qk_norm: bool = False  # RMSNorm on each head's query and key before RoPE (`Qwen3Attention.q_norm`, `k_norm`)
    residual_dropout: bool = False  # a llama-like layer's dropout on each sublayer's output before the residual add
    #   (`Phi3DecoderLayer.resid_attn_dropout`, `resid_mlp_dropout`, resid_pdrop)
    # The forward's end (`components.decoder_locals`; transformers 5.23.0 `models/<type>/modeling_<type>.py` lines):
    forward_locals: tuple[str, ...] = ()  # tensors the model forward keeps in Python locals, which no autograd node
    #   saves, beside every layer's forward until it returns (`decoder_locals.LOCALS` sizes each): "inputs_embeds"
    #   (GPT-2 567/575, OPT 338/369-371: summed with the positions), "position_embeds" (GPT-2 `wpe` 574, OPT
    #   `pos_embeds` 366), "position_ids" (OPT 354-355, GPT-NeoX 333-334), "position_attention_mask" (OPT 350:
    #   `torch.ones(batch, seq)`), "undropped_embeds" (GPT-NeoX 344: `emb_dropout(inputs_embeds)`), "alibi" (BLOOM
    #   514-518), "eager_mask" (GPT-NeoX 336, BLOOM 520: `create_causal_mask`; GPT-2's and OPT's are not listed)
    attention_adds_residual: bool = False  # the attention module runs the residual add itself, its locals alive
    #   (`BloomAttention.forward(hidden_states, residual, ...)`, 309: `dropout_add(output_tensor, residual, ...)`)
    parallel_residual_sum: bool = False  # with `use_parallel_residual` the layer's output is one expression of two
    #   out-of-place adds, `mlp_output + attn_output + hidden_states` (`GPTNeoXLayer.forward`, 260-263)
    # Linear layers and MLP:
    fused_projections: bool = False  # one qkv_proj and one gate_up_proj Linear (`Phi3Attention`, `Phi3MLP`)
    conv1d: bool = False  # projections are transformers' `Conv1D` (weight stored (in, out)), not nn.Linear (GPT-2)
    transposed_weight_matmul: bool = False  # the decoder's Linears compute `input @ self.weight.T` (`FalconLinear`):
    #   autocast casts that view anew at each call and caches nothing
    mlp_activation: str = "gated"  # the MLP: "gated" (down(act(gate) * up): SiLU, Gemma's tanh GELU), "gelu"
    #   (up -> GELU -> down, the gelu saving its input), "gelu-new" (GPT-2's `NewGELUActivation`), "relu" (OPT),
    #   "bloom-gelu" (`BloomGelu`'s custom autograd function)
    # Mixture of experts:
    grouped_experts: bool = False  # experts as 3-D tensors run by grouped matrix products (`MixtralExperts`,
    #   `Qwen2MoeExperts` with a `<Type>TopKRouter`)
    routing_weights_fp32: bool = False  # the router hands the experts its fp32 top-k weights (`MixtralTopKRouter`);
    #   otherwise cast back to the router logits' dtype (`Qwen2MoeTopKRouter`)
    topk_renormalized: bool = False  # the router always divides the top-k weights by their sum (Mixtral); otherwise
    #   the config's `norm_topk_prob` decides (Qwen2-MoE)
    shared_expert: bool = False  # a dense shared expert with a sigmoid gate beside the routed ones
    #   (`Qwen2MoeSparseMoeBlock.shared_expert`, `shared_expert_gate`)
    # What llmem models for the architecture (coverage, not structure):
    liger_kernel: bool = False  # Liger-Kernel 0.8.5 has `apply_liger_kernel_to_<model_type>` (fused linear CE)
    context_parallel: bool = False  # `--cp`'s moments measured on its program (`components.context_parallel`)
    pipeline_stages: bool = False  # `--pp`'s stage forward (`runtime.pipeline.Stage`, the llama-like
    #   `Model.forward`) builds and was measured on it (`components.pipeline`)
    float8_linears: bool = False  # `--float8`: a gated MLP of nn.Linears whose down_proj torchao converts, measured
    #   (`components.float8`)
    request_stream: bool = False  # the reserved replay writes its layer's requests out (`components.request_stream`)
    lora_activations: bool = False  # the LoRA activation table (`components.lora_activations`) covers its layer:
    #   llama's decoder layer (separate q/k/v/o and gate/up/down Linears, two pre-norms, a dense MLP, or a
    #   grouped-experts MoE block kept frozen: `lora_moe.moe_targets_refusal`); without it
    #   LoRA's tables are traced from the PEFT model (`lora_activations.traced_spec`)
    last_block_moments: bool = False  # the last block's moments above the forward's end are modelled: its MLP's
    #   output dropout beside its `attn_output` local, its attention inside sdpa's CPU math path
    #   (`decoder_locals.gpt2_block_end_bytes`, `gpt2_math_sdpa_bytes`: `GPT2Block.forward` 274-282, `GPT2MLP.forward`
    #   241-242). GPT-NeoX's layer keeps `attn_output` too: only its parallel add is modelled
    #   (`parallel_residual_sum`)

    def build(self, raw: dict) -> ModelSpec:
        c = Config(raw, self.defaults, KEYS.get(self.model_type, {}))
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
