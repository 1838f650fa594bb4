"""A decoder layer's backward under tensor parallelism written out op by op for `request_stream`'s replay: the
temporaries that decide which freed blocks the fp32 weight gradients split (docs/notes/2026-11-27-tp-request-stream.md);
its forward is `request_stream_tp_forward`'s.

Under TP the backward of every ColwiseParallel Linear (q, k, v, gate, up) all-reduces its input gradient
(torch 2.13 torch/distributed/tensor/parallel/style.py `ColwiseParallel._prepare_input_fn`: the input is
redistributed from Replicate, whose backward is a partial-to-replicate all-reduce of the gradient, a new tensor of
the input's shape and dtype: the residual stream's, fp32 under autocast), and the two gradients of a block are
summed in that dtype (`add`). Around them the op-level tensors of the llama-like layer's backward (transformers 5.23
models/llama/modeling_llama.py: RMSNorm, rotate_half RoPE, SDPA, the gated MLP), each allocated and freed where
autograd does: the half gradient of a Linear's output (the autocast cast's backward, `ToCopyBackward0`), the half
weight gradient then its fp32 cast (`.grad`), the input gradient cast back to fp32, RMSNorm's backward products in
fp32, RoPE's `slice_backward`/`neg` pieces; the layer's saved tensors freed as the op that reads them finishes.
Only the large pool's requests (> 1 MiB at full size) and the gradients are written; small temporaries live in
their own pool. The order follows `simulate`'s record of the real program (qwen2.5-1.5b, TP 2, bf16-mixed) op by op.
In pure bf16 (no autocast) the residual stream, RoPE and the Linears are in bf16 and RMSNorm casts its input to fp32
and its normalized product back (`hidden_states.to(torch.float32)` ... `.to(input_dtype)`): it saves the fp32 copy,
not its input, so a layer's input and its mid-layer residual die as the layer returns (`_norm_forward`,
`_norm_half`; the order of qwen2.5-0.5b TP 2, 1 × 1024, pure bf16's record).
"""

from __future__ import annotations

import math

from llmem.components import autocast
from llmem.components.request_events import layer_kinds
from llmem.components.sharding import local_numel, tp_local_shape

F32 = 4


def applies(plan) -> bool:
    """Whether the layers are written op by op (`request_stream.per_op`): under TP (autocast, fp32 or pure bf16)."""
    return plan.tp > 1


def backward(req, spec, plan, kept: list, g_in: int, grads: list, grad, tokens: int) -> None:
    """The final norm's and each layer's backward, the saved tensors freed by name; the residual gradient into the
    embedding freed as `embedding_dense_backward` is made (here: before it)."""
    g_res = final_norm_backward(req, spec, plan, g_in, tokens, kept[-1][0])
    kinds = layer_kinds(spec)
    for layer in reversed(range(spec.num_layers)):
        req.mark(f"layer {layer} backward")
        new, g_res = req.layer(kinds[layer], _layer_backward, (kept[layer + 1], g_res), spec, plan, layer,
                               grad, tokens)
        grads.extend(new)
    req.free(g_res)


class _Layer:
    """Sizes (bytes) of one layer's backward tensors: T·H in fp32 and in the compute dtype, the local q and kv
    widths, the local MLP width; each Linear by its short name (q, k, v, o, gate, up, down)."""

    def __init__(self, spec, plan, layer: int, tokens: int | None) -> None:
        c = plan.precision.compute_bytes
        self.cast = autocast.applies(plan)  # autocast's copies and casts; else (fp32) the tensors themselves
        # pure half precision: RMSNorm casts its input to fp32 and its output back (`hidden_states.to(float32)`)
        self.norm_cast = not self.cast and c != F32
        self.rope = F32 if self.cast else c  # RoPE's products: fp32 under autocast, else the compute dtype
        self.c, self.tokens, self.head_dim = c, tokens, spec.head_dim
        r = plan.precision.param_bytes  # the residual stream: the parameters' dtype
        self.f_th, self.c_th, self.r_th = (("tp f_th", "tp c_th", "tp r_th") if tokens is None else
                                           (tokens * spec.hidden_size * n for n in (F32, c, r)))
        self.linear, self.bias = {}, {}
        for p in spec.layer_params(layer):
            short = p.name.split(".")[-2]
            if p.name.endswith(".weight") and len(p.shape) >= 2:
                self.linear[short] = p
            elif p.name.endswith(".bias"):
                self.bias[short] = p
        self.plan = plan
        self.width = {k: math.prod(tp_local_shape(p, plan.tp)[:-1]) for k, p in self.linear.items()
                      if p.tp_split.value == "colwise"}

    def rows(self, name: str, nbytes: int, half: bool = False):
        """A tensor of `tokens` rows of the local width of Linear `name`'s output (`half`: of half its width); a
        layout's stream (`tokens` None): the slot's name, filled per plan by `slots`."""
        if self.tokens is None:
            return f"tp {name} {nbytes}{' half' if half else ''}"
        n = self.tokens * self.width[name] * nbytes
        return n // 2 if half else n


def slots(spec, plan, tokens: int) -> dict:
    """The sizes of a layout's op-by-op stream that follow the micro-batch and the sequence, by slot name (every
    layer of a llama-like decoder has layer 0's shapes)."""
    s = _Layer(spec, plan, 0, tokens)
    named = {"tp f_th": s.f_th, "tp c_th": s.c_th, "tp r_th": s.r_th}
    for name in s.width:
        for nbytes in (s.c, F32):
            named[f"tp {name} {nbytes}"] = s.rows(name, nbytes)
            named[f"tp {name} {nbytes} half"] = s.rows(name, nbytes, half=True)
    return named


def _layer_backward(req, given: tuple, spec, plan, layer: int, grad, tokens) -> tuple[list[int], int]:
    """`layer_backward` on `given` (its saved tensors, the residual gradient), for `Requests.layer`."""
    return layer_backward(req, spec, plan, layer, *given, grad, tokens)


def layer_backward(req, spec, plan, layer: int, kept: dict, g_res: int, grad, tokens: int) -> tuple[list[int], int]:
    """One layer's backward; `kept` its saved tensors by name ("<Linear> weight copy": the copies), `g_res` the key of
    the residual stream's fp32 gradient coming in; `grad(req, numel, cast)` allocates a parameter's `.grad`. Returns
    the gradients' keys and the residual gradient going out."""
    s = _Layer(spec, plan, layer, tokens)
    grads: list[int] = []
    free = _Freer(req, kept)
    acc = _mlp(req, s, free, grads, grad)
    g_mid = _norm(req, s, free, acc, g_res, "post_attention_layernorm", "residual after attention")
    acc = _attention(req, s, free, grads, grad, g_mid)
    g_out = _norm(req, s, free, acc, g_mid, "input_layernorm", "input (residual stream)")
    free.rest()
    return grads, g_out


def final_norm_backward(req, spec, plan, d_out: int, tokens: int, final) -> int:
    """The final RMSNorm's backward on the lm_head's input gradient (`d_out`, the compute dtype): cast to fp32, the
    norm's products; returns the residual stream's gradient into the last layer. `final`: the norm's input (the last
    layer's output), or in pure half precision its saved tensors by name (`request_stream_tp_forward.forward`)."""
    s = _Layer(spec, plan, spec.num_layers - 1, tokens)
    x32 = req.alloc(s.f_th) if s.cast else d_out
    if s.cast:
        req.free(d_out)
    saved = final if isinstance(final, dict) else {"input": final}
    return _norm(req, s, _Freer(req, saved), x32, 0, "norm", "input")


class _Freer:
    """Frees saved tensors by name (a name not saved by this plan is skipped); `rest` frees what is left."""

    def __init__(self, req, kept: dict) -> None:
        self.req, self.kept = req, dict(kept)

    def __call__(self, *names: str) -> None:
        for n in names:
            if n in self.kept:
                self.req.free(self.kept.pop(n))

    def weight(self, short: str) -> None:
        """Autocast's half copy of Linear `short`'s weight (kept under the parameter's name)."""
        self(f"{short} weight copy")

    def prefix(self, start: str) -> None:
        self(*[k for k in self.kept if k.startswith(start)])

    def rest(self) -> None:
        self.req.free(*reversed(list(self.kept.values())))
        self.kept.clear()


def _linear(req, s: _Layer, free: _Freer, grads: list, grad, name: str, d_out: int, saved: tuple) -> int:
    """A Linear's backward: the half input and weight gradients (`mm`; with a bias, `addmm`'s backward makes the
    input's first), `d_out`, the saved input cast and weight copy freed, the input gradient cast to the fp32 input's
    dtype, the fp32 `.grad` (and the bias's), then, ColwiseParallel, the all-reduce; returns the input gradient."""
    p = s.linear[name]
    numel = local_numel(p, s.plan)
    if name in s.bias:
        d_x, d_w = req.alloc(s.c_th), req.alloc(numel * s.c)
    else:
        d_w, d_x = req.alloc(numel * s.c), req.alloc(s.c_th)
    req.free(d_out)
    free.weight(name)
    free(f"input cast {name}", *saved)
    if not s.cast:  # fp32: the weight gradient is the `.grad`, the input gradient the residual stream's dtype
        grads.append(d_w)
        if name in s.bias:
            grads.append(grad(req, local_numel(s.bias[name], s.plan), False))
        return all_reduce(req, s.plan, d_x, s.r_th)
    x32 = req.alloc(s.f_th)
    req.free(d_x)
    grads.append(req.alloc(numel * s.plan.precision.param_bytes))
    req.free(d_w)
    if name in s.bias:
        grads.append(grad(req, local_numel(s.bias[name], s.plan), False))
    return all_reduce(req, s.plan, x32, s.f_th)


def all_reduce(req, plan, key: int, nbytes: int) -> int:
    """TP's all-reduce of the tensor `key` (`funcol.all_reduce`: a new output of its size, the input freed); one
    rank: the tensor itself."""
    if plan.tp == 1:
        return key
    out = req.alloc(nbytes)
    req.free(key)
    return out


def _mlp(req, s: _Layer, free: _Freer, grads: list, grad) -> int:
    g = req.alloc(s.c_th) if s.cast else 0  # the output gradient in the compute dtype
    down = s.linear["down_proj"]
    d_w = req.alloc(local_numel(down, s.plan) * s.c)
    d_x = req.alloc(s.rows("up_proj", s.c))
    if s.cast:
        req.free(g)
    free.weight("down_proj")
    free("silu(gate) * up")
    if s.cast:
        grads.append(req.alloc(local_numel(down, s.plan) * s.plan.precision.param_bytes))
        req.free(d_w)
    else:
        grads.append(d_w)
    d_up, d_silu = req.alloc(s.rows("up_proj", s.c)), req.alloc(s.rows("up_proj", s.c))
    req.free(d_x)
    free("up_proj", "silu(gate)")
    a_up = _linear(req, s, free, grads, grad, "up_proj", d_up, ())
    d_gate = req.alloc(s.rows("gate_proj", s.c))  # silu_backward
    req.free(d_silu)
    free("gate_proj")
    a_gate = _linear(req, s, free, grads, grad, "gate_proj", d_gate, ("post_attention_layernorm.output",))
    acc = req.alloc(s.r_th)
    req.free(a_up, a_gate)
    return acc


def _norm(req, s: _Layer, free: _Freer, d_out: int, g_res: int, norm: str, residual: str) -> int:
    """RMSNorm's backward in fp32 (x · rsqrt(mean(x²) + eps) · w: the products `mul`, `div`, `pow`), then the
    residual stream's gradient summed with the incoming one; returns its key."""
    if s.norm_cast:
        return _norm_half(req, s, free, d_out, g_res, norm)
    m1, m2 = req.alloc(s.f_th), req.alloc(s.f_th)
    req.free(m2, d_out)
    free(f"{norm}.normalized", f"{norm}.output")
    m3, m4 = req.alloc(s.f_th), req.alloc(s.f_th)
    req.free(m3, m1)
    add = req.alloc(s.f_th)
    req.free(*(k for k in (g_res, m4) if k))
    free(f"{norm}.rsqrt")
    d, pw, ms, mt = (req.alloc(s.f_th) for _ in range(4))
    req.free(ms, pw, d)
    free(residual)
    out = req.alloc(s.f_th)
    req.free(add, mt)
    return out


def _norm_half(req, s: _Layer, free: _Freer, d_out: int, g_res: int, norm: str) -> int:
    """`_norm` in pure half precision: the weight's products in the compute dtype, the gradient cast to fp32
    (`.to(input_dtype)`'s backward), the fp32 products, their sum cast back (`.to(float32)`'s backward), then summed
    with the incoming residual gradient (the input itself is not saved: its fp32 copy is)."""
    m1, m2 = req.alloc(s.c_th), req.alloc(s.c_th)
    req.free(m2, d_out)
    free(f"{norm}.normalized", f"{norm}.output")
    x32 = req.alloc(s.f_th)
    req.free(m1)
    m3, m4 = req.alloc(s.f_th), req.alloc(s.f_th)
    req.free(m3, x32)
    free(f"{norm}.rsqrt")
    d, pw, ms, mt = (req.alloc(s.f_th) for _ in range(4))
    req.free(ms, pw, d)
    free(f"{norm}.to_fp32")
    add = req.alloc(s.f_th)
    req.free(m4, mt)
    cast = req.alloc(s.c_th)
    req.free(add)
    if not g_res:
        return cast
    out = req.alloc(s.c_th)
    req.free(g_res, cast)
    return out


def _rope(req, s: _Layer, x32: int, name: str) -> int:
    """rotate_half's backward on q or k (`apply_rotary_pos_emb`): fp32 products, half casts, `neg`,
    two `slice_backward`, their sums; returns the gradient of the projection's output."""
    f, c = s.rows(name, s.rope), s.rows(name, s.c)
    m = req.alloc(f)
    c1 = req.alloc(c) if s.cast else m  # fp32: no half casts, the products themselves
    if s.cast:
        req.free(m)
    ng = req.alloc(s.rows(name, s.c, half=True))
    s1 = req.alloc(c)
    req.free(ng)
    s2 = req.alloc(c)
    req.free(c1)
    ad = req.alloc(c)
    req.free(s1, s2)
    m2 = req.alloc(f)
    c2 = req.alloc(c) if s.cast else m2
    if s.cast:
        req.free(m2)
    req.free(x32)
    out = req.alloc(c)
    req.free(ad, c2)
    return out


def _contiguous(req, s: _Layer, key: int, name: str) -> int:
    """The q or k gradient back through `.view(hidden_shape).transpose(1, 2)`: (b, heads, s, d) transposed is not
    viewable as (b, s, heads · d) unless one head is local, so `reshape` copies it (`clone`); v's gradient comes out
    of SDPA's backward in v's own strides and needs none."""
    if s.width[name] // s.head_dim <= 1:
        return key
    out = req.alloc(s.rows(name, s.c))
    req.free(key)
    return out


def _attention(req, s: _Layer, free: _Freer, grads: list, grad, g_mid: int) -> int:
    g = req.alloc(s.c_th) if s.cast else 0
    o = s.linear["o_proj"]
    d_w = req.alloc(local_numel(o, s.plan) * s.c)
    d_x = req.alloc(s.rows("q_proj", s.c))
    if s.cast:
        req.free(g)
        free.weight("o_proj")
        grads.append(req.alloc(local_numel(o, s.plan) * s.plan.precision.param_bytes))
        req.free(d_w)
    else:
        grads.append(d_w)
    dq, dk, dv = req.alloc(s.rows("q_proj", s.c)), req.alloc(s.rows("k_proj", s.c)), req.alloc(s.rows("v_proj", s.c))
    req.free(d_x)
    free("k_embed (RoPE)", "q_embed (RoPE)", "v_proj", "sdpa logsumexp", "sdpa output")
    if s.cast:  # the gradients cast to RoPE's fp32 output
        q32 = req.alloc(s.rows("q_proj", F32))
        req.free(dq)
        k32 = req.alloc(s.rows("k_proj", F32))
        req.free(dk)
        dq, dk = q32, k32
    dk = _rope(req, s, dk, "k_proj")
    dq = _rope(req, s, dq, "q_proj")
    a_v = _linear(req, s, free, grads, grad, "v_proj", dv, ())
    a_k = _linear(req, s, free, grads, grad, "k_proj", _contiguous(req, s, dk, "k_proj"), ())
    free.prefix("k_norm")
    acc = req.alloc(s.r_th)
    req.free(a_v, a_k)
    a_q = _linear(req, s, free, grads, grad, "q_proj", _contiguous(req, s, dq, "q_proj"), ("input_layernorm.output",))
    free.prefix("q_norm")
    out = req.alloc(s.r_th)
    req.free(acc, a_q)
    return out
