"""A decoder layer's forward under tensor parallelism written out op by op for `request_stream`'s replay (the
backward's counterpart, `request_stream_tp`): each tensor allocated as the op that makes it runs and kept by name
while a later op (or autograd, for the backward) holds it, in the order of `simulate`'s record of the real program
(transformers 5.23 models/llama/modeling_llama.py; TP's all-reduces from torch 2.13
torch/distributed/tensor/parallel/style.py)."""

from __future__ import annotations

from llmem.components import request_stream_tp as tp_ops
from llmem.components.request_events import layer_kinds
from llmem.components.request_stream_tp import _Layer
from llmem.components.sharding import local_numel


def forward(req, spec, plan, table: dict, embedded: int, tokens: int) -> list:
    """Each layer's forward (`layer_forward`) on the embedding's output `embedded`; returns [[], each layer's kept
    tensors by name ..., [the last layer's output]]."""
    kept: list = [[]]
    res = embedded
    for layer, kind in enumerate(layer_kinds(spec)):
        req.mark(f"layer {layer} forward")
        named, res = req.layer((kind, layer == 0), _layer, res, spec, plan, layer, table, tokens)
        kept.append(named)
    s = _Layer(spec, plan, spec.num_layers - 1, tokens)
    if not s.norm_cast:
        return [*kept, [res]]
    final = {"input": res}  # the final norm (`model.norm`), then the last layer's output and the embedding's freed
    _norm_forward(req, s, final, {}, "norm")
    req.free(final.pop("input"), embedded)
    return [*kept, [final]]


def _layer(req, residual: int, spec, plan, layer: int, table: dict, tokens) -> tuple[dict, int]:
    """`layer_forward` for `Requests.layer` (the first layer's input, the embedding's output, is freed by `forward`:
    the layer's `kind` says whether it is the first)."""
    return layer_forward(req, spec, plan, layer, table, residual, tokens)


def layer_forward(req, spec, plan, layer: int, table: dict, residual: int, tokens: int,
                  held_input: bool = False) -> tuple[dict, int]:
    """One layer's forward op by op (the order of `simulate`'s record, as `layer_backward`): RMSNorm's fp32
    products, autocast's half weight copies and input casts per Linear, the q/k/v outputs, RoPE in fp32 with its
    half casts for SDPA, the RowwiseParallel outputs' all-reduce (`RowwiseParallel._prepare_output_fn`: Partial to
    Replicate, a new tensor) before the fp32 residual add. `table` the layer's saved tensors by name (sizes);
    `residual` the key of the layer's input. Returns the kept tensors by name ("<Linear> weight copy": the copies) and
    the layer's output's key. A saved tensor this does not make (qwen3's q/k norms) is allocated after the layer.
    `held_input`: the input is held past the layer by its caller (a checkpoint's recompute), kept by name."""
    s = _Layer(spec, plan, layer, tokens)
    kept = {"input (residual stream)": residual}
    o1 = _norm_forward(req, s, kept, table, "input_layernorm")
    out = {}
    for name in ("q_proj", "k_proj", "v_proj"):
        _copy(req, s, kept, name)
        out[name] = req.alloc(s.rows(name, s.c))
    kept["v_proj"] = out.pop("v_proj")
    qe, ke = _rope_forward(req, s, "q_proj"), _rope_forward(req, s, "k_proj")
    req.free(out["q_proj"], out["k_proj"])
    if s.cast:  # SDPA's inputs in the compute dtype, RoPE's fp32 outputs freed after o_proj
        kept["k_embed (RoPE)"] = req.alloc(s.rows("k_proj", s.c))
        kept["q_embed (RoPE)"] = req.alloc(s.rows("q_proj", s.c))
        temps = (qe, ke, o1)
    else:
        kept["k_embed (RoPE)"], kept["q_embed (RoPE)"], temps = ke, qe, ()
    kept["sdpa output"] = req.alloc(s.rows("q_proj", s.c))
    _keep(req, kept, "sdpa logsumexp", table.get("sdpa logsumexp", 0))
    mid = _row_parallel(req, s, kept, "o_proj", temps)
    kept["residual after attention"] = mid
    o2 = _norm_forward(req, s, kept, table, "post_attention_layernorm")
    for name, saved in (("gate_proj", ("gate_proj", "silu(gate)")), ("up_proj", ("up_proj", "silu(gate) * up"))):
        _copy(req, s, kept, name)
        for n in saved:
            kept[n] = req.alloc(s.rows(name, s.c))
    res = _row_parallel(req, s, kept, "down_proj", (o2,) if s.cast else ())
    if s.norm_cast:  # saved by no op (the norms save their fp32 copies): freed as the layer returns, but the first
        req.free(kept.pop("residual after attention"))  # layer's input (the embedding's output, freed by `forward`)
        if not held_input:
            first = kept.pop("input (residual stream)")
            if layer:
                req.free(first)
    for name, nbytes in table.items():
        if name not in kept and not name.startswith("autocast input"):
            _keep(req, kept, name, nbytes)
    return kept, res


def _keep(req, kept: dict, name: str, nbytes) -> None:
    if nbytes.__class__ is str or nbytes > 0:
        kept[name] = req.alloc(nbytes)


def _copy(req, s: _Layer, kept: dict, name: str, cast_input: bool = True) -> None:
    """Autocast's half copy of the Linear's weight and of its fp32 input (both saved by the matmul); fp32: none."""
    if not s.cast:
        return
    p = s.linear[name]
    kept[f"{name} weight copy"] = req.alloc(local_numel(p, s.plan) * s.c)
    if cast_input:
        kept[f"input cast {name}"] = req.alloc(s.c_th)


def _norm_forward(req, s: _Layer, kept: dict, table: dict, norm: str) -> int:
    """RMSNorm in fp32: `pow` (freed), the rsqrt and the normalized input (saved), the weighted output (returned).
    Pure half precision: the input's fp32 copy first (saved), the normalized product cast back (saved, its fp32
    product freed) and the weighted output (saved: the Linears' input)."""
    if s.norm_cast:
        kept[f"{norm}.to_fp32"] = req.alloc(s.f_th)
        req.free(req.alloc(s.f_th))
        _keep(req, kept, f"{norm}.rsqrt", table.get(f"{norm}.rsqrt", 0))
        n32 = req.alloc(s.f_th)
        kept[f"{norm}.normalized"], kept[f"{norm}.output"] = req.alloc(s.c_th), req.alloc(s.c_th)
        req.free(n32)
        return 0
    req.free(req.alloc(s.f_th))
    _keep(req, kept, f"{norm}.rsqrt", table.get(f"{norm}.rsqrt", 0))
    kept[f"{norm}.normalized"] = req.alloc(s.f_th)
    if s.cast:  # the weighted output, cast per Linear (`_copy`)
        return req.alloc(s.f_th)
    kept[f"{norm}.output"] = req.alloc(s.f_th)  # fp32: the Linears' saved input itself
    return 0


def _rope_forward(req, s: _Layer, name: str) -> int:
    """`apply_rotary_pos_emb` on q or k: x · cos (fp32), rotate_half's `neg` and `cat` (half), · sin, the sum."""
    f, c = s.rows(name, s.rope), s.rows(name, s.c)
    m1 = req.alloc(f)
    ng = req.alloc(s.rows(name, s.c, half=True))
    cat = req.alloc(c)
    req.free(ng)
    m2 = req.alloc(f)
    req.free(cat)
    out = req.alloc(f)
    req.free(m1, m2)
    return out


def _row_parallel(req, s: _Layer, kept: dict, name: str, temps: tuple) -> int:
    """A RowwiseParallel Linear: its half weight copy (saved), the partial output, the all-reduce's output, then the
    fp32 residual sum; returns the sum's key."""
    _copy(req, s, kept, name, cast_input=False)  # its input (SDPA's, the MLP product) is already half
    reduced = tp_ops.all_reduce(req, s.plan, req.alloc(s.c_th), s.c_th)
    req.free(*temps)
    res = req.alloc(s.r_th)
    req.free(reduced)
    return res
