"""`Derived`: the activation tables of an architecture outside `llmem.families`, traced and fitted per plan.

What the walk asks of a family, answered from the trace (`llmem.derive.trace`) instead of a hand-written table:
  layer_saved     one decoder layer's saved tensors: those of its kind (`llmem.derive.kinds`; `at(layer)` answers
                  for decoder layer `layer`, the spec itself for layer 0; `layer_kinds` maps the layers to kinds)
  outer_saved     before the layers or shared by them: input_ids, embeddings' saves, RoPE cos/sin, masks
  final_saved     after the last layer: the final norm's saves and the lm_head's input
  held_saved      with checkpointing, the decoder layers' other tensor arguments the checkpoints keep
                  (`torch.utils.checkpoint` closes over the call's args; e.g. position_ids, a sliding-window mask)
                  of the checkpointed layers taking them, until the lowest one's backward (`held_released_bytes`)
  backward_extra_bytes  the peak of a decoder layer's backward beyond its saved tensors (traced allocations), of
                  its kind
Each entry's bytes are the fitted polynomial (`llmem.derive.fit`) at the plan's (batch, seq).
LoRA plans trace the PEFT model (`llmem.derive.lora`): layer 0, whose input may need no gradient, is then simply a
kind of its own (it saves less).
TP plans trace the wrapped model of TP rank 0 under torch's fake process group (`llmem.derive.tp`).
A dropout (the model's or LoRA's) is traced as the plan's device runs it: on the cuda profile through CUDA's branches
(`llmem.simulate.patches.cuda_kernel_choices`: `native_dropout`'s bool mask; sdpa's dropout inside the fused kernel).
Refused (one line naming the field): TP without a plan in the config (by the walk's checks), experts other than
`llmem.derive.experts` derives, anything saved on the logits other than a softcapping tanh.
"""

from __future__ import annotations

import copy
import operator

from llmem.components.saved import Saved
from llmem.derive import cache, depth, experts, kinds
from llmem.derive.config_reads import band, dropout_keys, static_refusal  # noqa: F401 (re-exported)
from llmem.derive.fit import fit_sequence, monomials, regime, shifted
from llmem.errors import InputError
from llmem.memo import remembered
from llmem.plan import GradCkpt, TrainingPlan
from llmem.quiet import quiet_libraries
from llmem.spec import ModelSpec

MOE_KEYS = experts.EXPERT_KEYS
CHECKPOINTED = "checkpointed"  # a key's last field: full fine-tuning with --grad-ckpt full (`Derived.key`)
_KIND_PLACES = ("layer", "backward", "forward", "accumulating", "inflight", "recompute", "sdpa", "sdpa accumulating")


class Derived:
    """The traced tables of one config; pure-Python answers once a (precision, attention) pair is fitted. The
    layer tables answer for decoder layer `layer` (0 unless a view made by `at`)."""

    def __init__(self, config: dict, model_type: str):
        self.config, self.model_type, self.layer, self.half_adapters = config, model_type, 0, False
        self._fits: dict = {}
        self._plan_fits: dict = {}  # plan key -> its fits (`key` reads a dozen plan fields; asked ~100 times)
        self._evaluated: dict = {}  # (plan key, layer kind, place) -> its saved tensors (`_saved`)

    def at(self, layer: int) -> Derived:
        """The same tables (and fits, shared) answering for decoder layer `layer`."""
        view = copy.copy(self)
        view.layer = layer
        return view

    def with_half_adapters(self) -> Derived:
        """The tables of the PEFT model whose adapters compute in the parameters' half dtype (FSDP2's
        MixedPrecisionPolicy all-gathers them cast to it: `llmem.derive.lora.wrap`); fits of their own per plan."""
        view = copy.copy(self)
        view.half_adapters, view._plan_fits, view._evaluated = True, {}, {}
        return view

    def layer_kinds(self, plan: TrainingPlan) -> list[int]:
        """Each decoder layer's kind (`llmem.derive.kinds`) under the plan's fits."""
        return self.fitted(plan)["layer_kinds"]

    @property
    def family(self):
        """A `Family` with no closed-form inventory (the spec's parameters come from the meta device). Its traits:
        RoPE when the config carries rotary parameters (`rope_theta`, `rope_parameters`; the trace saves what the
        rotary embedding makes either way), sdpa asked of transformers (which refuses it, `--attn eager` named, when
        the model has none); no Megatron plan (its config's own runs: `llmem.derive.tp`), Liger patch or LoRA table
        is modelled for it. The walk reads its traced tables, not the structural traits."""
        from llmem.families import Family

        rope = any(self.config.get(k) is not None for k in ("rope_theta", "rope_parameters", "rotary_emb_base"))
        return Family(self.model_type, {}, lambda *a: [], lambda *a: [], rope=rope)

    def key(self, plan: TrainingPlan) -> tuple:
        """(dtype, autocast dtype, attention, sequence band, batch regime, kernels), ("tp", degree) under TP, under
        LoRA the traced PEFT program's fields (`llmem.derive.lora.trace_key`), else CHECKPOINTED with --grad-ckpt full.
        `kernels`: "cuda" when the cuda profile runs a dropout: CUDA's dropout kernels save other tensors."""
        from llmem.components.lora import is_lora
        from llmem.plan import Device
        from llmem.spec import attention_implementation

        p = plan.precision
        lora = is_lora(plan)
        cuda = plan.device is Device.CUDA and (self.has_dropout() or (lora and plan.lora_dropout > 0))
        base = (p.torch_dtype_name, p.compute_dtype_name if p.is_mixed else "",
                attention_implementation(self.model_type, plan.attn),
                band(self.config, plan.seq_len), regime(plan.batch_size), "cuda" if cuda else "")
        ckpt = (CHECKPOINTED,) if plan.grad_ckpt is GradCkpt.FULL and not lora else ()  # (`trace`'s checkpointed)
        if plan.tp > 1:  # traced on TP rank 0 under the fake process group (`llmem.derive.tp`); LoRA after TP
            from llmem.derive.lora import trace_key

            return (*base, ("tp", plan.tp), *((trace_key(plan),) if lora else ()), *ckpt)
        if not lora:
            return (*base, *ckpt)
        from llmem.derive.lora import trace_key

        return (*base, (*trace_key(plan), "half adapters") if self.half_adapters else trace_key(plan))

    def has_dropout(self) -> bool:
        """Whether the model runs a dropout: a dropout key above 0 in the config or its configuration class's
        defaults (gpt2's resid_pdrop)."""
        if not hasattr(self, "_dropout"):  # on disk beside the tables: a cached estimate imports no transformers
            cached = cache.load(self.config, ("dropout",))
            self._dropout = cached if isinstance(cached, bool) else \
                cache.store(self.config, ("dropout",), bool(dropout_keys(self.config)))
        return self._dropout

    def output_layer(self) -> str:
        """The output layer's module name (`llmem.derive.head`: the model's `get_output_embeddings()`)."""
        from llmem.derive.head import output_layer

        return output_layer(self.config)

    def fitted(self, plan: TrainingPlan) -> dict:
        """The fits of the plan's (dtype, autocast dtype, attention, sequence band, batch regime)."""
        return remembered(self._plan_fits, plan.key, lambda: self._fitted(self.key(plan)))

    def _fitted(self, k: tuple) -> dict:
        if k not in self._fits:
            self._fits[k] = cache.load(self.config, k) or cache.store(self.config, k, self._trace_and_fit(k))
        return self._fits[k]

    def _trace_and_fit(self, k: tuple) -> dict:
        from llmem.derive.tp import fake_group
        ckpt = k[-1] == CHECKPOINTED
        (dtype, mixed, attn, offset, kind, kernels), rest = k[:6], k[6:len(k) - ckpt]
        tp = rest[0][1] if rest and rest[0][:1] == ("tp",) else 1
        lora = rest[0] if rest and tp == 1 else (rest[1] if len(rest) > 1 else None)
        config, mapping = self._shallower()
        with fake_group(tp):
            built = self._build(config, dtype, attn, lora, tp=tp)
            experts.check_grouped(built[1], self.model_type)
            fits = self._fit(built, kind, mixed or None, offset, kernels == "cuda", ckpt)
            paths = [] if mapping is None else _layer_paths(built)
        from llmem.derive.lora import checkpointed_windows, is_checkpointed

        traced = None
        if lora is not None and is_checkpointed(lora):  # --grad-ckpt full: a layer's backward runs its recompute
            built = self._build(config, dtype, attn, lora, checkpointed=True)
            traced = self._traces(built, kind, mixed or None, offset, kernels == "cuda")
            per = fits["layer_kinds"] if mapping is None else list(range(len(built[2])))  # prefix: per layer
            fits["checkpointed backward"] = checkpointed_windows(traced, per, kind, offset)
        if fits.get("returns_probs") and mapping is None and tp == 1 and (lora is None or is_checkpointed(lora)):
            # the checkpointed program's first forward (`Derived.returned_probs_bytes`)
            if traced is None:
                with quiet_libraries():
                    traced = self._traces(self._build(config, dtype, attn, lora, checkpointed=True), kind,
                                          mixed or None, offset, kernels == "cuda")
            fits["returned probs"] = fit_sequence("returned probabilities", [t.returned for t in traced[0]],
                                                  [t.returned for t in traced[1]], kind, offset)
        return fits if mapping is None else depth.expand(fits, mapping, paths)

    def _build(self, config: dict, dtype: str, attn: str, lora, checkpointed: bool = False, tp: int = 1):
        from llmem.derive.trace import build

        try:
            with quiet_libraries():
                return build(config, dtype, attn, lora, checkpointed, tp)
        except ValueError as e:  # e.g. an architecture without an sdpa path (a TP refusal passes through)
            if isinstance(e, InputError):
                raise
            first = (str(e).strip().splitlines() or [""])[0]
            first = first.split(". ")[0].rstrip(".") if len(first) > 160 else first.rstrip(".")
            raise InputError("attn", f"{self.model_type!r} with --attn {attn}: {first[:200]}; use --attn eager") \
                from None
        except Exception as e:  # noqa: BLE001 - e.g. a vision tower whose construction reads tensor values
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            raise InputError("model_type", f"{self.model_type!r}: transformers cannot build this model on fake "
                             f"tensors ({type(e).__name__}: {first}); for a multimodal config, estimate its text "
                             "model (the config's text_config)") from None

    def _shallower(self) -> tuple[dict, list[int] | None]:
        """The config to trace: a prefix of the layers with every layer role (`llmem.derive.depth`) and the prefix
        layer of each layer, or the config itself (None)."""
        from llmem.plan import TrainingPlan
        from llmem.runtime.model import hf_config

        with quiet_libraries():
            values = hf_config(self.config, TrainingPlan()).to_dict()
        layers = values.get("num_hidden_layers")
        if not isinstance(layers, int):
            return self.config, None
        if self.model_type not in depth.VERIFIED:
            return self.config, None
        keys, settings = depth.per_layer_settings(values, layers)
        # (the hand-written MoE families are traced for TP too)
        modules = depth.layer_modules(inventory(self.config, experts.TP_TRACED_MOE).params, layers)
        planned = depth.plan_depth(self.model_type, [s + m for s, m in zip(settings, modules, strict=True)])
        if planned is None:
            return self.config, None
        d, mapping = planned
        prefix = {**self.config, "num_hidden_layers": d, **{k: list(values[k][:d]) for k in keys}}
        from llmem.meta import meta_spec

        with quiet_libraries():  # the prefix builds its layers as the full model's first d (a list read otherwise)
            built = depth.layer_modules(meta_spec(prefix).params, d)
        return (prefix, mapping) if built == modules[:d] else (self.config, None)

    def _traces(self, built, kind: str, mixed: str | None, offset: int, cuda: bool, ckpt: bool = False) \
            -> tuple[list, list]:
        """The traces at regime `kind`'s fit points and check points (`ckpt`: `trace`'s `checkpointed`)."""
        from llmem.derive.trace import trace

        points, check_points, _ = shifted(kind, offset)
        try:
            return ([trace(built, b, s, mixed, cuda, ckpt) for b, s in points],
                    [trace(built, b, s, mixed, cuda, ckpt) for b, s in check_points])
        except Exception as e:  # noqa: BLE001 - a config transformers builds but cannot run (mismatched sizes)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            raise InputError("model_type", f"{self.model_type!r}: transformers builds this config but its forward "
                             f"fails ({first}); check the sizes (heads, key/value heads, head_dim)") from None

    def _fit(self, built, kind: str, mixed: str | None, offset: int, cuda: bool, ckpt: bool = False) -> dict:
        traces, checks = self._traces(built, kind, mixed, offset, cuda, ckpt)
        places = ("outer", "final", "head", "held", "locals")
        fits = {place: fit_sequence(place, [getattr(t, place) for t in traces], [getattr(t, place) for t in checks],
                                    kind, offset) for place in places}
        if any((t.held_layers, t.outer_layers) != (traces[0].held_layers, traces[0].outer_layers)
               for t in traces + checks):
            raise InputError("model_type", f"{self.model_type!r}: the layers taking each argument or sharing a saved "
                             "tensor change with batch or sequence length; this architecture cannot be derived")
        tables, layer_kinds = kinds.group(traces, checks, kind, offset)
        return fits | {"kinds": tables, "layer_kinds": layer_kinds, "held_layers": traces[0].held_layers,
                       "outer_layers": traces[0].outer_layers, "grad_excess": traces[0].grad_excess,
                       "returns_probs": traces[0].returns_probs}

    def _saved(self, plan: TrainingPlan, place: str) -> list[Saved]:
        fits = self.fitted(plan)
        this = fits["layer_kinds"][self.layer]
        table = fits["kinds"][this].get(place, []) if place in _KIND_PLACES \
            else fits[place][this] if place == "checkpointed backward" else fits[place]
        # each layer of a kind asks for the same table: evaluated once per plan
        return list(remembered(self._evaluated, (plan.key, this, place), lambda: _evaluated(table, plan)))

    def layer_saved(self, plan: TrainingPlan) -> list[Saved]:
        return self._saved(plan, "layer")

    def outer_saved(self, plan: TrainingPlan) -> list[Saved]:
        return self._saved(plan, "outer")

    def final_saved(self, plan: TrainingPlan) -> list[Saved]:
        head = self._saved(plan, "head")
        if head and not (len(head) == 1 and "tanh" in head[0].name and self.config.get("final_logit_softcapping")):
            raise InputError("model_type", f"{self.model_type!r} saves tensors on the logits that are not modelled "
                             f"({head[0].name}); use a modelled family")
        return self._saved(plan, "final")

    def held_saved(self, plan: TrainingPlan) -> list[Saved]:
        """The layer arguments a checkpointed layer takes (an argument only layers the checkpointing skips take
        dies with the model forward)."""
        lowest = self.lowest_holders(plan)
        return [s for s, low in zip(self._saved(plan, "held"), lowest, strict=True) if low is not None]

    def held_released_bytes(self, plan: TrainingPlan, layer: int) -> int:
        """Of `held_saved`, the arguments released before decoder layer `layer`'s backward: a checkpointed layer's
        frame lets its arguments go when its backward is done, so each lives until the backward of the lowest
        checkpointed layer taking it."""
        lowest = self.lowest_holders(plan)
        return sum(s.bytes for s, low in zip(self._saved(plan, "held"), lowest, strict=True)
                   if low is not None and low > layer)

    def outer_released_bytes(self, plan: TrainingPlan, layer: int) -> int:
        """Of `outer_saved`, the tensors only decoder layers above `layer` saved (e.g. the full-attention layers'
        RoPE tables in Gemma 3): autograd frees a saved tensor with the last node saving it, in the backward of the
        lowest layer that saved it (whose backward window counts that free), so they are gone below it."""
        fits = self.fitted(plan)
        return sum(s.bytes for s, layers in zip(self._saved(plan, "outer"), fits["outer_layers"], strict=True)
                   if layers and min(layers) > layer)

    def returned_probs_bytes(self, plan: TrainingPlan) -> tuple[int, int]:
        """Where the decoder layers return their eager attention probabilities (`trace_live.note_returned`), traced
        on the checkpointed program (every layer checkpointed): (the bytes of the previous layer's return alive at
        the last layer's start, which only the model's loop holds there; the peak of the last layer's forward from
        its start, `trace_live.first_forward_window`). (0, 0) otherwise (`components.returned_probs`)."""
        if "returned probs" not in self.fitted(plan):
            return 0, 0
        saved = self._saved(plan, "returned probs")
        return saved[0].bytes, max((s.bytes for s in saved[1:]), default=0)

    def buffer_bytes(self, plan: TrainingPlan) -> int:
        """The model's buffers in the plan's parameter dtype (`llmem.derive.buffers`)."""
        from llmem.derive.buffers import buffer_bytes

        return buffer_bytes(self.config, plan.precision.torch_dtype_name)

    def gradient_excess_bytes(self, plan: TrainingPlan) -> int:
        return self.fitted(plan).get("grad_excess", 0)  # the `.grad`s beyond their parameters: `Trace.grad_excess`

    def lowest_holders(self, plan: TrainingPlan) -> list[int | None]:
        """Per held argument, the lowest checkpointed layer taking it (None: no checkpointed layer does)."""
        return [min((k for k in layers if plan.checkpointed(k)), default=None)
                for layers in self.fitted(plan)["held_layers"]]

    def backward_extra_bytes(self, spec: ModelSpec, plan: TrainingPlan) -> int:
        """The largest live total of a decoder layer's backward beyond its saved tensors (and everything alive
        before it), as traced: the gradient of its output, its weight gradients and the transient activation
        gradients, less the saved tensors (and autocast weight copies) its nodes have released by then. A
        checkpointed layer's backward runs after its recompute restored the same saved tensors (the walk holds
        them, `activations.recompute_bytes`), each freed when the node unpacking it returns: the window traced so
        (`Derived.key`'s CHECKPOINTED, `trace_live.unpacked`); its recompute is a moment of its own
        (`recompute_extra_bytes`). Traced LoRA with `--grad-ckpt full`: the window of the checkpointed program,
        recompute included (`llmem.derive.lora.checkpointed_extra_bytes`)."""
        if "checkpointed backward" in self.fitted(plan):
            from llmem.derive.lora import checkpointed_extra_bytes

            window = max(s.bytes for s in self._saved(plan, "checkpointed backward"))
            return checkpointed_extra_bytes(spec, plan, window)
        extra = max(s.bytes for s in self._saved(plan, "backward"))
        if plan.grad_ckpt is GradCkpt.FULL:  # `plan` is the layer's (`activations.layer_plan`)
            extra = max(extra, self.recompute_extra_bytes(plan))
        return extra

    def accumulated_backward_extra_bytes(self, spec: ModelSpec, plan: TrainingPlan) -> int:
        """`backward_extra_bytes` in a later micro-step of --grad-accum (or with kept gradients): the same window
        with each weight gradient added in place into its `.grad` as it is made (`trace._window`'s `in_place`),
        so the layer's earlier weight gradients are no longer new at a later event. Traced LoRA: unchanged (its
        adapters' gradients are a few kB)."""
        if "checkpointed backward" in self.fitted(plan):
            return self.backward_extra_bytes(spec, plan)
        extra = max(s.bytes for s in self._saved(plan, "accumulating"))
        if plan.grad_ckpt is GradCkpt.FULL:
            extra = max(extra, self.recompute_extra_bytes(plan))
        return extra

    def forward_inflight_extra_bytes(self, plan: TrainingPlan) -> int:
        """A layer's forward at its largest (`trace.Trace.inflight`: from its pre-hook to its output, transients
        included; e.g. gpt-oss's clamped GLU experts, six r × i tensors at once) beyond the saved tensors it leaves
        (all but its input, which existed before it), so at least 0: on top of every earlier layer's saves, the peak
        of a forward whose backward is light (LoRA on frozen experts)."""
        inflight = self._saved(plan, "inflight")
        if not inflight:
            return 0
        saved = sum(s.bytes for s in self.layer_saved(plan) if not s.name.startswith("input (residual"))
        return max(0, max(s.bytes for s in inflight) - saved)

    def locals_bytes(self, plan: TrainingPlan) -> int:  # beside the last layer's forward in flight
        return sum(s.bytes for s in self._saved(plan, "locals"))  # (`trace_live.unsaved_locals`)

    def recompute_extra_bytes(self, plan: TrainingPlan) -> int:
        """A checkpointed layer's recompute at its largest: the largest live total of the layer's forward relative
        to its start, on top of what the backward holds when it triggers it (the output gradient and the nodes'
        outputs before the first unpack, `trace._trigger`; traced per kind, `trace.Trace.forwards`: saved tensors and
        transients), less the saved tensors the walk holds for the layer already (all but its input, which the
        checkpoint kept), plus on the cpu profile the recompute's own copy of the CPU RNG state (torch 2.13
        `utils/checkpoint.py`: `fork_rng` around the recompute, `torch.get_rng_state()`, freed when it ends). E.g.
        gpt-oss's clamped GLU experts make six r × i transients at once, after its trigger made a r × h gradient.
        Where the walk counts the layer's autocast weight copies whole (`autocast.applies`; not traced LoRA, whose
        tables hold them), the window counts each copy from the event that makes it, less all of them
        (`trace.Trace.recomputes`): phi's recompute peaks in its attention core, before dense's, fc1's and fc2's
        copies exist."""
        from llmem.components import autocast
        from llmem.components.activations import CPU_RNG_STATE_BYTES
        from llmem.components.lora import is_lora
        from llmem.plan import Device

        copies = autocast.applies(plan) and not is_lora(plan)
        forward = (copies and self._saved(plan, "recompute")) or self._saved(plan, "forward")
        if not forward:
            return 0
        saved = sum(s.bytes for s in self.layer_saved(plan) if not s.name.startswith("input (residual"))
        rng = CPU_RNG_STATE_BYTES if plan.device is Device.CPU else 0
        return max(s.bytes for s in forward) - saved + rng


def _layer_paths(built) -> list[str]:
    """The module path of each decoder layer of a model from `trace.build` (its names in the traced tables)."""
    names = {m: n for n, m in built[1].named_modules()}
    return [names.get(layer, "") for layer in built[2]]


_HALF_STATISTICS = ("native_layer_norm[1] torch.bfloat16", "native_layer_norm[2] torch.bfloat16",
                    "native_layer_norm[1] torch.float16", "native_layer_norm[2] torch.float16")


def _evaluated(table: list, plan: TrainingPlan) -> tuple[Saved, ...]:
    """A fitted table's tensors at the plan's micro-batch and sequence length (`fit.evaluate`, the monomials once)."""
    terms = monomials(plan.batch_size, plan.seq_len)
    return tuple(Saved(name, _cuda_bytes(name, sum(map(operator.mul, c, terms)), plan)) for name, c in table)


def _cuda_bytes(name: str, nbytes: int, plan: TrainingPlan) -> int:
    """The trace runs CPU kernels; under the cuda profile a half-precision LayerNorm's mean and rstd differ: half on
    CPU (torch 2.13 `layer_norm_cpu`: the input's dtype) and fp32 on CUDA (`layer_norm_kernel.cu`: `acc_type`),
    twice the bytes. (A dropout is traced through CUDA's branch already, `Derived.key`.)"""
    from llmem.plan import Device

    if plan.device is Device.CUDA and name.endswith(_HALF_STATISTICS):
        return 2 * nbytes
    return nbytes


from llmem.derive.inventory import derived_spec, inventory, is_cached  # noqa: E402, F401 (re-exported)
