"""Trace the model's own final norm: what its backward allocates above what its forward saved.

The final norm (`LlamaRMSNorm`, transformers 5.23 `models/llama/modeling_llama.py` lines 52-66:
`hidden.to(float32)`, `variance = hidden.pow(2).mean(-1, keepdim=True)`, `hidden * torch.rsqrt(variance + eps)`,
then `self.weight * hidden.to(input_dtype)`; GPT-2's `ln_f`, an `nn.LayerNorm`, `models/gpt2/modeling_gpt2.py`
lines 495, 617) runs backward after the lm_head's and before the last decoder layer's. The model is built as
`llmem.derive.trace` builds it (`AutoModelForCausalLM.from_config` on fake tensors, never remote code) with one
decoder layer, in the parameter dtype of the plan; its final norm is the module with parameters that runs between
the last decoder layer's forward and the lm_head's (found by forward hooks, not by name). That module alone then
runs forward on a fake input of the residual stream's dtype (fp32 under autocast), under `torch.autocast` for mixed
precision, and backward from an output gradient that only autograd's engine holds (made by the backward of a scalar
multiplication after the norm, as the lm_head's `MmBackward0` makes it in the real step), inside the allocation
tracker (`llmem.simulate.tracker`). The curve is the live bytes after each event of the backward, relative to the
moment before the output gradient exists (so it includes that gradient, the input and weight gradients and the
release of the norm's own saved tensors).

Each event's bytes are a · tokens · h + b · tokens + c · h + d: traced at four (tokens, h) points and solved
exactly, checked at a fifth (a mismatch raises: the curve is then no such polynomial). `curve` returns the events
no other event dominates. `python -m llmem.derive.final_norm` prints `llmem.components.final_norm_table` for the
hand-written families.
"""

from __future__ import annotations

from fractions import Fraction

POINTS = ((8, 16), (16, 16), (8, 32), (16, 48))
CHECK = (24, 80)
KINDS = ("fp32", "half", "mixed")


ROTARY_FRACTIONS = ("partial_rotary_factor", "rotary_pct")


def _config(config: dict, h: int) -> dict:
    """The config with one decoder layer of hidden size `h` (one head of size h) and a small MLP (the vocabulary its
    own: fake tensors allocate nothing), RoPE on the whole head: the layer runs only to find the norm, and a fraction
    of a head of size h can round to an odd width, which transformers' rotary embeddings cannot run (phi's 0.4 × 48
    = 19 rotated channels against cos/sin of 20: `PhiRotaryEmbedding` makes `arange(0, dim, 2)` frequencies, then
    `apply_rotary_pos_emb` broadcasts them, transformers 5.23 models/phi/modeling_phi.py:63, 109)."""
    sizes = dict(hidden_size=h, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                 intermediate_size=2 * h, n_embd=h, n_layer=1, n_head=1, n_inner=2 * h,
                 ffn_dim=2 * h, word_embed_proj_dim=h, layer_types=None, moe_intermediate_size=h,
                 shared_expert_intermediate_size=h, num_experts=2, num_local_experts=2, num_experts_per_tok=1,
                 **dict.fromkeys(ROTARY_FRACTIONS, 1.0))
    from transformers import AutoConfig

    known = AutoConfig.for_model(config["model_type"])
    keep = {k: v for k, v in config.items() if k not in sizes}
    for key in ("rope_parameters", "rope_scaling"):  # transformers 5 keeps the fraction among the RoPE parameters
        if isinstance(keep.get(key), dict):
            keep[key] = {k: 1.0 if k in ROTARY_FRACTIONS else v for k, v in keep[key].items()}
    fields = known.to_dict()
    return {**keep, **{k: v for k, v in sizes.items() if k in config or k in fields}}


def _final_norm(model, layers):
    """The module with parameters that runs after the last decoder layer's forward and before the lm_head's."""
    import torch

    order, state = [], {"after": False}
    head = model.get_output_embeddings()

    def pre(module, args):
        if module is head:
            state["after"] = False
        elif state["after"] and any(True for _ in module.parameters(recurse=False)):
            order.append(module)

    handles = [m.register_forward_pre_hook(pre) for m in model.modules()]
    handles.append(layers[-1].register_forward_hook(lambda *a: state.update(after=True)))
    from llmem.simulate.stand_ins import stand_ins
    from llmem.simulate.tracker import AllocationTracker

    tracker = AllocationTracker()
    tracker.stand_ins = stand_ins()  # grouped MoE experts' `aten._grouped_mm`, as `llmem.derive.trace` runs them
    try:
        with torch.no_grad(), tracker:
            model(input_ids=torch.zeros((1, 4), dtype=torch.long))
    finally:
        for h in handles:
            h.remove()
    return order[0] if order else None


def _events(config: dict, kind: str, frozen: bool, tokens: int, h: int) -> list[int] | None:
    """The live bytes after each event of the final norm's backward at (tokens, h), relative to its start."""
    import torch

    from llmem.derive.trace import build
    from llmem.simulate.tracker import AllocationTracker

    dtype = "float32" if kind != "half" else "bfloat16"
    mode, model, layers, _ = build(_config(config, h), dtype, "eager")
    with mode:
        norm = _final_norm(model, layers)
    if norm is None:
        return None
    for p in norm.parameters():
        p.requires_grad_(not frozen)
    tracker = AllocationTracker()
    for t in (*norm.parameters(), *norm.buffers()):
        tracker.outside_allocator(t.untyped_storage())
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind == "mixed")
    with mode:
        x = torch.zeros((1, tokens, h), dtype=getattr(torch, dtype), requires_grad=True)
        with tracker:
            with autocast:
                z = norm(x) * 2.0  # (a scalar mul: its backward makes the norm's output gradient, which only
            seed = torch.ones_like(z)  # the engine holds then, as the lm_head's input gradient in the real step)
            start = len(tracker.events)
            z.backward(seed)
    live, out = 0, []
    for k, (_, _, delta) in enumerate(tracker.events):
        live += delta
        if k >= start:
            out.append(live)
    before = sum(d for _, _, d in tracker.events[:start])
    return [v - before for v in out]


def _solve(points, values) -> list[Fraction]:
    """(a, b, c, d) with a·t·h + b·t + c·h + d = value at each (t, h) of `points` (Gauss-Jordan, exact)."""
    rows = [[Fraction(t * h), Fraction(t), Fraction(h), Fraction(1), Fraction(v)]
            for (t, h), v in zip(points, values, strict=True)]
    for i in range(4):
        p = next(r for r in range(i, 4) if rows[r][i] != 0)
        rows[i], rows[p] = rows[p], rows[i]
        rows[i] = [v / rows[i][i] for v in rows[i]]
        for r in range(4):
            if r != i and rows[r][i]:
                rows[r] = [a - rows[r][i] * b for a, b in zip(rows[r], rows[i], strict=True)]
    return [rows[i][4] for i in range(4)]


def curve(config: dict, kind: str, frozen: bool = False) -> tuple[tuple[int, int, int, int], ...]:
    """The final norm backward's events as (a, b, c, d) coefficients, the dominated ones dropped; () without a
    final norm."""
    traces = [_events(config, kind, frozen, t, h) for t, h in (*POINTS, CHECK)]
    if traces[0] is None:
        return ()
    if len({len(tr) for tr in traces}) != 1:
        raise RuntimeError(f"{config.get('model_type')}: the final norm's backward differs in events across sizes")
    events = []
    for k in range(len(traces[0])):
        coef = _solve(POINTS, [tr[k] for tr in traces[:4]])
        t, h = CHECK
        exact = all(c.denominator == 1 for c in coef)
        if coef[0] * t * h + coef[1] * t + coef[2] * h + coef[3] != traces[4][k] or not exact:
            raise RuntimeError(f"{config.get('model_type')}: event {k} is not a·t·h + b·t + c·h + d")
        events.append(tuple(int(c) for c in coef))
    kept = [e for e in dict.fromkeys(events)
            if not any(o != e and all(x >= y for x, y in zip(o, e, strict=True)) for o in events)]
    return tuple(kept)


_CURVES: dict = {}


def cached_curve(config: dict, kind: str, frozen: bool) -> tuple:
    """`curve`, remembered in the process and on disk (`llmem.derive.cache`) per config and library versions."""
    from llmem.derive import cache
    from llmem.quiet import quiet_libraries

    key = ("final-norm", kind, frozen)
    memo = (repr(sorted(config.items(), key=str)), key)
    if memo not in _CURVES:
        stored = cache.load(config, key)
        if stored is None:
            try:
                with quiet_libraries():
                    events = curve(config, kind, frozen)
            except (RuntimeError, ValueError, TypeError, KeyError, AttributeError, AssertionError):
                events = ()  # a norm this trace cannot run alone: no moment (as before it was modelled)
            stored = cache.store(config, key, [list(e) for e in events])
        _CURVES[memo] = tuple(tuple(e) for e in stored)
    return _CURVES[memo]


def table_text() -> str:
    """The module `llmem.components.final_norm_table`: every hand-written family's curves, traced."""
    from llmem.families import FAMILIES
    from llmem.quiet import quiet_libraries

    lines = []
    with quiet_libraries():
        for model_type in sorted(FAMILIES):
            for kind in KINDS:
                for frozen in (False, True):
                    events = curve({"model_type": model_type}, kind, frozen)
                    lines.append(f"    ({model_type!r}, {kind!r}, {frozen}): {events},")
    return HEAD + "\n".join(lines) + "\n}\n"


HEAD = ('"""Generated by `python -m llmem.derive.final_norm` (torch 2.13.0, transformers 5.23.0): each hand-written '
        "family's\nfinal norm backward, traced (`llmem.derive.final_norm.curve`): (model_type, kind, frozen) -> the "
        "events'\n(a, b, c, d), live bytes a · tokens · h + b · tokens + c · h + d above the start of its backward.\n"
        '"""\n\nCURVES = {\n')


if __name__ == "__main__":
    print(table_text(), end="")
