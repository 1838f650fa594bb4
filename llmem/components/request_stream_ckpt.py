"""Checkpointed decoder layers, op by op, for `request_stream`'s replay (one GPU, DDP, ZeRO-1, TP with `--grad-ckpt
full`, every `ckpt_every`-th layer, under autocast, in fp32 or in pure bf16; or `selective` under autocast;
docs/notes/2026-11-27-reserved-tp-bf16.md, docs/notes/2026-11-28-reserved-ckpt-streams.md).

Forward: non-reentrant `torch.utils.checkpoint` (torch 2.13 torch/utils/checkpoint.py) saves nothing of the layer
but its input, so each tensor dies after its last reader, and autocast's half weight copies stay in its cache
(`cached_casts`, aten/src/ATen/autocast_mode.cpp: a leaf fp32 weight's cast is kept to the autocast region's exit,
before `loss.backward()`). Backward, per layer, last first: the recompute (the forward again, saving what autograd
saves: `request_stream_tp_forward.layer_forward` at one rank) on the kept input, then the layer's backward
(`request_stream_tp.layer_backward`, whose all-reduces are the tensors themselves at one rank). The forward's order
is `simulate`'s record (qwen2.5-0.5b, 1 × 1024, bf16-mixed; transformers 5.23 models/llama/modeling_llama.py).
Selective (torchtitan's policy, `llmem.runtime.selective`): the forward also keeps the outputs the policy saves
(`policy_saved`); the recompute takes them out of the checkpoint's cache as it reaches their ops (here: freed as it
starts, made again by it), but for an output dispatched after the layer's last pack (the down projection's), which
the early-stopped recompute never takes out: it stays to the end of the layer's backward (`SavedOutputs.extra`).
`--ckpt-every K` (transformers' `every_n_layers`: layer i checkpointed when i % K == 0): the other layers run as
without checkpointing (`request_stream_tp_forward.layer_forward`, their backward as above). Under TP the
RowwiseParallel outputs (o_proj, down_proj) are all-reduced into new tensors in the forward too
(`_row_parallel`). Without autocast there are no weight copies or input casts; in pure bf16 RMSNorm casts to fp32
and back (`_norm`), the final norm (not checkpointed) saves its fp32 copy rather than the last layer's output, and
a checkpointed layer's input is held by the checkpoint to the end of its backward (`held_input`)."""

from __future__ import annotations

from llmem.choices import GradCkpt
from llmem.components import autocast
from llmem.components import request_stream_tp as tp_ops
from llmem.components import request_stream_tp_forward as tp_forward
from llmem.components.request_events import layer_kinds
from llmem.components.request_stream_tp import _Layer
from llmem.components.sharding import FSDP_SCHEMES, local_numel


def applies(plan) -> bool:
    """One GPU, DDP, ZeRO-1 or TP (not FSDP2: `request_stream_fsdp`) with `--grad-ckpt full` (any `ckpt_every`;
    autocast, fp32 or pure bf16) or `selective` under autocast."""
    if plan.grad_ckpt is GradCkpt.SELECTIVE and not autocast.applies(plan):
        return False  # pure bf16's policy outputs not written out (llama-3.2-1b, 1 × 1024: +3.4 %)
    return plan.grad_ckpt is not GradCkpt.NONE and plan.scheme not in FSDP_SCHEMES


def forward(req, spec, plan, tokens, embedded: int, table: dict) -> list:
    """Each layer on the previous one's output (the embedding's first): a checkpointed one (`plan.checkpointed`)
    with its input kept by the checkpoint, any other saving what autograd saves (`request_stream_tp_forward`);
    returns [[], [a checkpointed layer's input] or another's kept tensors by name ..., [the last layer's output],
    the cached weight copies]."""
    cached: list = []
    kept, res = [[]], embedded
    for layer, kind in enumerate(layer_kinds(spec)):
        if not plan.checkpointed(layer):  # `every_n_layers`: this layer runs as without checkpointing
            named, res = req.layer((kind, layer == 0), tp_forward._layer, res, spec, plan, layer,
                                   table, tokens)
            kept.append(named)
            continue
        res, copies, held = req.layer(kind, _checkpointed, res, spec, plan, layer, tokens)
        cached += copies
        kept.append(held)
    s = _Layer(spec, plan, spec.num_layers - 1, tokens)
    if not s.norm_cast:
        return [*kept, [res], cached]
    final = {"input": res}  # pure half precision: the final norm saves its fp32 copy, not its input
    tp_forward._norm_forward(req, s, final, {}, "norm")
    req.free(final.pop("input"))
    return [*kept, [final], cached]


def backward(req, spec, plan, kept: list, g_in: int, grads: list, table: dict, tokens) -> None:
    """The final norm's backward, then per layer, last first, its recompute (the op-by-op forward of
    `request_stream_tp_forward`, saving what autograd saves, on the kept input; its output dropped) and its
    backward (`request_stream_tp.layer_backward`: at one rank its all-reduces are the tensors themselves)."""
    g_res = tp_ops.final_norm_backward(req, spec, plan, g_in, tokens, kept[-1][0])
    kinds = layer_kinds(spec)
    for layer in reversed(range(spec.num_layers)):
        new, g_res = req.layer(kinds[layer], _layer_backward, (kept[layer + 1], g_res), spec, plan, layer,
                               table, tokens)
        grads.extend(new)
    req.free(g_res)


def _checkpointed(req, res: int, spec, plan, layer: int, tokens) -> tuple[int, list, list]:
    """`layer_forward` on the input `res` for `Requests.layer`: (its output, its cached weight copies, [its input,
    the policy's saved outputs])."""
    cached, kept = [], [res]
    return layer_forward(req, spec, plan, layer, tokens, cached, kept), cached, kept


def _layer_backward(req, given: tuple, spec, plan, layer: int, table: dict, tokens) -> tuple[list, int]:
    """A layer's backward (`given`: its kept tensors, the residual gradient coming in): a checkpointed one's recompute
    first; returns the gradients' keys and the residual gradient going out."""
    kept, g_res = given
    if isinstance(kept, dict):  # not checkpointed: its saved tensors
        return tp_ops.layer_backward(req, spec, plan, layer, kept, g_res, _grad(plan), tokens)
    inp, *held = kept
    extra = [k for n, k in held if n == LINEARS[-1]]  # dispatched after the last pack: never taken out
    req.free(*(k for n, k in held if k not in extra))  # taken out of the cache as the recompute reaches them
    named, out = tp_forward.layer_forward(req, spec, plan, layer, table, inp, tokens, held_input=True)
    req.free(out)
    new, g_res = tp_ops.layer_backward(req, spec, plan, layer, named, g_res, _grad(plan), tokens)
    req.free(*extra)
    return new, g_res


def _grad(plan):
    return lambda req, numel, cast: req.alloc(numel * plan.precision.param_bytes)


LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def policy_saved(spec, plan, layer: int = 0) -> set:
    """Selective: the outputs torchtitan's policy saves (`llmem.runtime.selective.policy`): SDPA's and every
    odd-numbered `aten.mm` of the layer's forward (a Linear with a bias runs `addmm`, not in the save list)."""
    if plan.grad_ckpt is not GradCkpt.SELECTIVE:
        return set()
    biased = {p.name.split(".")[-2] for p in spec.layer_params(layer) if p.name.endswith(".bias")}
    mms = [n for n in LINEARS if n not in biased]
    return {"sdpa"} | set(mms[::2])


def policy_sizes(spec, plan, tokens) -> tuple[tuple, bool]:
    """Selective under FSDP2 (`request_stream_fsdp`): the sizes of the outputs the policy saves, in the forward's
    order (`layer_forward`'s, the compute dtype), and whether the last (the down projection's) is never taken out of
    the checkpoint's cache (dispatched after the layer's last pack); ((), False) without selective."""
    keep = policy_saved(spec, plan)
    if not keep:
        return (), False
    s = _Layer(spec, plan, 0, tokens)
    order = ("q_proj", "k_proj", "v_proj", "sdpa", "o_proj", "gate_proj", "up_proj", "down_proj")
    size = {n: s.c_th if n in ("o_proj", "down_proj") else s.rows("q_proj" if n == "sdpa" else n, s.c) for n in order}
    return tuple(size[n] for n in order if n in keep), LINEARS[-1] in keep


def layer_forward(req, spec, plan, layer: int, tokens, cached: list, kept: list) -> int:
    """One checkpointed layer on the input the caller keeps; its weight copies appended to `cached`, the policy's
    saved outputs (selective) to `kept` as (name, key); returns the key of its output."""
    s = _Layer(spec, plan, layer, tokens)
    keep = policy_saved(spec, plan, layer)
    held: set = set()

    def made(name: str, key: int) -> int:
        if name in keep:
            kept.append((name, key))
            held.add(key)
        return key

    def drop(*keys: int) -> None:
        req.free(*(k for k in keys if k not in held))

    o1 = _norm(req, s)
    out = {n: made(n, _linear(req, s, cached, n, cast=True)) for n in ("q_proj", "k_proj", "v_proj")}
    qe, ke = tp_forward._rope_forward(req, s, "q_proj"), tp_forward._rope_forward(req, s, "k_proj")
    drop(out["q_proj"], out["k_proj"])
    if s.cast:  # SDPA's inputs in the compute dtype
        qc, kc = req.alloc(s.rows("q_proj", s.c)), req.alloc(s.rows("k_proj", s.c))
    sdpa = made("sdpa", req.alloc(s.rows("q_proj", s.c)))
    if s.cast:
        req.free(qc, kc)
    o = made("o_proj", _row_parallel(req, s, _linear(req, s, cached, "o_proj", cast=False)))
    drop(qe, ke, o1, sdpa, out["v_proj"])
    mid = req.alloc(s.r_th)
    drop(o)
    o2 = _norm(req, s)
    g = made("gate_proj", _linear(req, s, cached, "gate_proj", cast=True))
    silu = req.alloc(s.rows("gate_proj", s.c))
    drop(g)
    u = made("up_proj", _linear(req, s, cached, "up_proj", cast=True))
    prod = req.alloc(s.rows("up_proj", s.c))
    drop(silu, u)
    d = made("down_proj", _row_parallel(req, s, _linear(req, s, cached, "down_proj", cast=False)))
    req.free(prod, o2)
    res = req.alloc(s.r_th)
    drop(d, mid)
    return res


def _norm(req, s: _Layer) -> int:
    """RMSNorm: `pow` (freed), the normalized product, the weighted output (returned), the product freed; in fp32
    under autocast or in fp32. Pure half precision: the input's fp32 copy first (freed after the normalized
    product), the product cast back (freed after the weighted output)."""
    if not s.norm_cast:
        req.free(req.alloc(s.f_th))
        n32 = req.alloc(s.f_th)
        out = req.alloc(s.f_th)
        req.free(n32)
        return out
    x32 = req.alloc(s.f_th)
    req.free(req.alloc(s.f_th))
    n32 = req.alloc(s.f_th)
    req.free(x32)
    half = req.alloc(s.c_th)
    out = req.alloc(s.c_th)
    req.free(half, n32)
    return out


def _linear(req, s: _Layer, cached: list, name: str, cast: bool) -> int:
    """Autocast's half weight copy (cached), the input's half cast (freed after the matmul), the output."""
    p = s.linear[name]
    if not s.cast:  # no autocast: the weight and the input themselves
        return req.alloc(s.c_th if name in ("o_proj", "down_proj") else s.rows(name, s.c))
    cached.append(req.alloc(local_numel(p, s.plan) * s.c))
    x = req.alloc(s.c_th) if cast else 0
    out = req.alloc(s.c_th if name in ("o_proj", "down_proj") else s.rows(name, s.c))
    req.free(x)
    return out


def _row_parallel(req, s: _Layer, partial: int) -> int:
    """TP: a RowwiseParallel Linear's partial output all-reduced into a new tensor (`_prepare_output_fn`, run in
    the module's forward hook, before anything its input frees), the partial freed; one rank: the output itself."""
    return tp_ops.all_reduce(req, s.plan, partial, s.c_th)
