"""The app's inputs <-> a URL query string, so that the address bar is always a link to the same view.

`encode` writes every input under its command-line option name (`?model=...&gpu-type=a100-80gb&gpus=8&...`).
`decode` never raises: an unknown key, a bad value, an out-of-range number or an invalid strategy combination
becomes a warning that names the field and the default used instead.

A link never names a file. The model value must be a preset name or a Hugging Face id (`org/name`); anything
that looks like a path (`/`, `~`, `.`, `..`, backslashes, more than one `/`, a file extension, or a name that
exists on disk) is refused, so a link can never make the server open one of its own files. An uploaded
config.json cannot travel in a link; `upload` only carries its display name so the app can say so.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, make_dataclass, replace

from llmem import support
from llmem.errors import InputError
from llmem.options import ALL, LINK_OPTIONS, MAX_TOKENS, WHEN_SET
from llmem.optiontypes import Option, as_probability
from llmem.plan import Method, OptimizerImpl, Quant, TrainingPlan

MAX_MODEL_CHARS = 200
QLORA_BASE = Quant.NF4  # the base a link or the app gives --method qlora when none is chosen

# One path-free part of a model name: what Hugging Face allows in an org or repo name.
_NAME_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
_MODEL_RE = re.compile(rf"{_NAME_PART}(/{_NAME_PART})?")
_FILE_SUFFIXES = (".json", ".yaml", ".yml", ".txt", ".py", ".bin", ".safetensors", ".gguf", ".pt", ".pth")

_AppFields = make_dataclass("_AppFields", [(o.name, object, o.app_value) for o in LINK_OPTIONS], frozen=True)


@dataclass(frozen=True)
class AppInputs(_AppFields):
    """Everything the app's view depends on: one field per option of `llmem.options.LINK_OPTIONS` (the model, the
    GPU type, the plan's options but the device, the upload's name, the methods compared). `zero` is 0-3, or "all"
    to compare every strategy; a quantized base without a method means qlora (as older links wrote it)."""

    def __post_init__(self) -> None:
        if self.quant is not Quant.NONE and self.method is Method.FULL:  # a 4-bit base alone has always meant qlora
            object.__setattr__(self, "method", Method.QLORA)

    @property
    def compare_all(self) -> bool:
        return self.zero == ALL

    def to_plan(self) -> TrainingPlan:
        """The plan to estimate. With zero=all this is the data-parallel base plan that `compare` varies; an option
        without meaning here (LoRA's without LoRA, ...) takes its default."""
        values = {o.name: getattr(self, o.name) for o in _PLAN_LINK}
        for o in _PLAN_NEEDS:
            if not o.needs.met(self):
                values[o.name] = o.default
        if self.compare_all:  # the data-parallel base plan (DeepSpeed's ZeRO-0: its engine's all-reduce)
            values |= {"tp": 1, "zero": 0}
        return TrainingPlan(**values)

    def with_(self, **changes) -> AppInputs:
        return replace(self, **changes)


# attribute -> query key (the command-line option name, so the URL reads like the CLI)
KEYS: dict[str, str] = {o.name: o.key for o in LINK_OPTIONS}
_OPTION = {o.key: o for o in LINK_OPTIONS}
_PLAN_LINK = tuple(o for o in LINK_OPTIONS if o.plan)
_PLAN_NEEDS = tuple(o for o in _PLAN_LINK if o.needs is not None)
_NEEDS = tuple(o for o in LINK_OPTIONS if o.needs is not None and o.needs.repair)
_FALLBACK = tuple(o for o in LINK_OPTIONS if o.fallback)


def encode(inputs: AppInputs) -> dict[str, str]:
    """Every input as `{query key: value}`; the options a link carries only when set (`llmem.options.WHEN_SET`:
    upload, method, LoRA's, ...) only when they differ from their defaults."""
    out = {}
    for o in LINK_OPTIONS:
        value = getattr(inputs, o.name)
        if o.link == WHEN_SET and value == o.app_value:
            continue
        out[o.key] = str(value).lower() if isinstance(value, bool) else str(value)
    return out


def check_model_name(value: str) -> str:
    """`value` if it is a preset name or a Hugging Face id; InputError("model") if it could name a file."""
    text = value.strip()
    if not text:
        raise InputError("model", "is empty; choose a preset or give a Hugging Face id such as org/name")
    if len(text) > MAX_MODEL_CHARS:
        raise InputError("model", f"is longer than {MAX_MODEL_CHARS} characters")
    looks_like_path = (
        text.startswith(("/", "~", ".", "\\"))
        or ".." in text
        or "\\" in text
        or text.count("/") > 1
        or text.lower().endswith(_FILE_SUFFIXES)
        or not _MODEL_RE.fullmatch(text)
    )
    if looks_like_path or os.path.lexists(text):
        raise InputError("model", f"{_show(text)} looks like a file path; a link may only name a preset or a "
                         "Hugging Face id (org/name). Upload a config.json in the app instead")
    return text


def decode(query: Mapping[str, object], defaults: AppInputs | None = None) -> tuple[AppInputs, list[str]]:
    """Inputs from a query string, and one warning per value that was ignored. Never raises."""
    defaults = defaults or AppInputs()
    values: dict[str, object] = {}
    warnings: list[str] = []

    def warn(attr: str, message: str) -> None:
        fallback = str(getattr(defaults, attr)) or "none"
        warnings.append(f"{KEYS[attr]}: {message}; using {fallback}")

    for key in sorted(query, key=str):
        raw = query[key]
        if isinstance(raw, list | tuple):  # a repeated key: the last value wins, as in st.query_params
            raw = raw[-1] if raw else ""
        option = _OPTION.get(str(key))
        if option is None:
            warnings.append(f"unknown link parameter {_show(str(key))} ignored")
            continue
        text = str(raw).strip()
        try:
            values[option.name] = _parse(option, text)
        except InputError as err:
            warn(option.name, _reason(err))
    implied = "method" not in values and values.get("quant", Quant.NONE) is not Quant.NONE  # an older link
    if values.get("method") is Method.FULL and values.get("quant", Quant.NONE) is not Quant.NONE:
        warnings.append(f"quant: {values['quant']} is the quantized base of --method qlora, not of full; using none")
        values["quant"] = Quant.NONE
    inputs = replace(defaults, **values)
    inputs = _make_consistent(inputs, defaults, warnings, method_implied=implied, quant_given="quant" in values)
    return inputs, warnings


def _parse(option: Option, text: str) -> object:
    """One link value as the app holds it, or InputError naming the option."""
    field = option.key
    if option.kind is str:
        return option.parse(text[:MAX_MODEL_CHARS] if option.plan else text) if option.parse else text
    if option.kind is bool:
        if text.lower() not in ("true", "false"):
            raise InputError(field, f"{_show(text)} is not true or false")
        return text.lower() == "true"
    if option.choice:
        return option.kind.parse(field, text)
    if option.kind is float:
        number = as_probability(field, text[:20])
        if not option.low <= number <= option.high:  # the widget's bounds: it refuses a value outside them
            raise InputError(field, f"{number} is outside {option.low}..{option.high}")
        return number
    if option.name == "zero" and text.lower() == ALL:
        return ALL
    if not re.fullmatch(r"[0-9]{1,9}", text):
        raise InputError(field, f"{_show(text)} is not a whole number")
    number = int(text)
    if option.name == "zero":
        if number not in (0, 1, 2, 3):
            raise InputError(field, f"{number} is not 0, 1, 2, 3 or all")
        return number
    if not option.low <= number <= option.high:
        raise InputError(field, f"{number} is outside {option.low}..{option.high}")
    return number


def _make_consistent(inputs: AppInputs, defaults: AppInputs, warnings: list[str], *, method_implied: bool = False,
                     quant_given: bool = True) -> AppInputs:
    """Fix combinations that are each valid alone but not together (TP vs GPU count, tokens per GPU, an option
    without the option it needs, a fine-tuning method and the strategy or precision it is not modelled with)."""
    if inputs.batch_size * inputs.seq_len > MAX_TOKENS:
        warnings.append(f"batch-size: {inputs.batch_size} × seq-len {inputs.seq_len} exceeds {MAX_TOKENS:,} "
                        f"tokens per GPU; using batch-size 1")
        inputs = replace(inputs, batch_size=1)
    inputs = _repair_needs(inputs, warnings)
    if inputs.tp > inputs.gpus or inputs.gpus % inputs.tp:
        warnings.append(f"tp: {inputs.tp} does not divide gpus {inputs.gpus}; using 1")
        inputs = replace(inputs, tp=1)
    # an optimizer and an implementation that never go together (adafactor + fused), whatever the strategy
    if (err := support.first_refusal(inputs, among=("optimizer", "optimizer_impl"))) is not None:
        warnings.append(f"{err.field}: {_reason(err)}; using {OptimizerImpl.DEFAULT}")
        inputs = replace(inputs, optimizer_impl=OptimizerImpl.DEFAULT)
    inputs = _consistent_method(inputs, warnings, method_implied, quant_given)
    inputs = _repair_needs(inputs, warnings)  # what a method's fall-back to full left without meaning
    inputs = _repair_fallbacks(inputs, defaults, warnings)
    # what the strategy's repair left without meaning (a method fallen back to full keeps double-quant)
    return _repair_needs(_repair_strategy(inputs, defaults, warnings), warnings)


def _repair_needs(inputs: AppInputs, warnings: list[str]) -> AppInputs:
    """An option set where it has no meaning (`Option.needs` with a repair: ckpt-every without grad-ckpt full, a
    quantized base without qlora, ...) goes back to its default, with the row's warning."""
    for option in _NEEDS:
        value = getattr(inputs, option.name)
        if value != option.app_value and not option.needs.met(inputs):
            reason = option.needs.repair.format(value=value, other=getattr(inputs, option.needs.attr))
            warnings.append(f"{option.key}: {reason}; using {_shown(option.app_value)}")
            inputs = replace(inputs, **{option.name: option.app_value})
    return inputs


def _repair_fallbacks(inputs: AppInputs, defaults: AppInputs, warnings: list[str]) -> AppInputs:
    """Options valid for some strategies only (`Option.fallback`: offload, loss, an optimizer, ...) that the plan
    refuses fall back to their defaults, never trading the strategy; with compare-all on several GPUs, those left out
    of the comparison (`Option.compared`) too."""
    for _ in _FALLBACK:
        try:
            inputs.to_plan()
            break
        except InputError as err:
            option = _OPTION.get(err.field)
            if option is None or not option.fallback:
                break
            inputs = _fall_back(inputs, option, err, defaults, warnings)
    for option in _FALLBACK:
        if inputs.compare_all and inputs.gpus > 1 and not option.compared_with(getattr(inputs, option.name)) \
                and getattr(inputs, option.name) is not getattr(defaults, option.name):
            err = InputError(option.key, "compare-all varies the strategy; pick one strategy for this option")
            inputs = _fall_back(inputs, option, err, defaults, warnings)
    return inputs


def compared(inputs: AppInputs) -> AppInputs:
    """The inputs "compare all" on several GPUs varies the strategy over: each option it leaves out for its value
    (`Option.compared`: offload, the fused loss) at its default; the others as they are."""
    if not (inputs.compare_all and inputs.gpus > 1):
        return inputs
    left_out = {o.name: getattr(AppInputs(), o.name) for o in _FALLBACK if not o.compared_with(getattr(inputs, o.name))}
    return replace(inputs, **left_out) if left_out else inputs


def _fall_back(inputs: AppInputs, option: Option, err: InputError, defaults: AppInputs,
               warnings: list[str]) -> AppInputs:
    fallback = getattr(defaults, option.name)
    warnings.append(f"{err.field}: {_reason(err)}; using {str(fallback) or 'none'}")
    return replace(inputs, **{option.name: fallback})


def _repair_strategy(inputs: AppInputs, defaults: AppInputs, warnings: list[str]) -> AppInputs:
    """What the plan still refuses: an option valid only on a strategy the link no longer has falls back to its
    default; else the method to full; else the ZeRO stage."""
    for _ in range(6):
        try:
            inputs.to_plan()
            return inputs
        except InputError as err:
            # e.g. adafactor with FSDP2, a fused impl; an option valid only on the strategy the link no longer has
            option = _OPTION.get(err.field)
            if option is not None and option.fallback:
                inputs = _fall_back(inputs, option, err, AppInputs(), warnings)
                continue
            if inputs.method is not Method.FULL and _valid(inputs.with_(method=Method.FULL, quant=Quant.NONE)):
                warnings.append(f"method: {inputs.method} does not go with these inputs ({err.field}: "
                                f"{_reason(err)}); using full")
                inputs = replace(inputs, method=Method.FULL, quant=Quant.NONE)
                continue
            zero = _valid_zero(inputs.gpus, inputs.tp)
            warnings.append(f"{err.field}: {_reason(err)}; using zero {zero}")
            inputs = replace(inputs, zero=zero)
    warnings.append("these inputs do not form a plan together; using the defaults")  # unreachable: never raise
    return replace(defaults, model=inputs.model, gpu_type=inputs.gpu_type)


def _method_plan(inputs: AppInputs, method: Method, quant: Quant, *, strategy: bool) -> TrainingPlan:
    """The plan fields a fine-tuning method is validated against (TrainingPlan's own rules): the GPU count and
    precision, and with `strategy` the chosen TP / ZeRO."""
    tp, zero = (inputs.tp, int(inputs.zero)) if strategy and not inputs.compare_all else (1, 0)
    return TrainingPlan(gpus=inputs.gpus, tp=tp, zero=zero, precision=inputs.precision, method=method, quant=quant,
                        lora_rank=inputs.lora_rank, lora_targets=inputs.lora_targets)


def _valid(inputs: AppInputs) -> bool:
    try:
        inputs.to_plan()
    except InputError:
        return False
    return True


def _consistent_method(inputs: AppInputs, warnings: list[str], method_implied: bool, quant_given: bool) -> AppInputs:
    """`method` and `quant` together, then against the GPU count, precision and strategy: a method that
    TrainingPlan rejects where full fine-tuning would run falls back to full (quant none), with a warning."""
    if inputs.method is Method.QLORA and inputs.quant is Quant.NONE:
        if quant_given:
            warnings.append("quant: none leaves --method qlora without its quantized base; using nf4")
        inputs = replace(inputs, quant=QLORA_BASE)
    pure = replace(inputs, precision=inputs.precision.pure)
    if inputs.method is Method.QLORA and inputs.precision.is_mixed and not method_implied \
            and not _valid(inputs) and _valid(pure):  # (a 4-bit base, --engine torch)
        warnings.append(f"precision: QLoRA under autocast is not modelled with these inputs; using "
                        f"{inputs.precision.pure}, the base's compute dtype")
        inputs = replace(inputs, precision=inputs.precision.pure)
    if inputs.method is Method.FULL:
        return inputs
    for strategy in (False, True):
        try:
            _method_plan(inputs, inputs.method, inputs.quant, strategy=strategy)
        except InputError as err:
            if strategy:
                try:  # a strategy error that full fine-tuning has too is fixed later by changing the strategy
                    _method_plan(inputs, Method.FULL, Quant.NONE, strategy=True)
                except InputError:
                    break
            if method_implied:  # an old link: quant=nf4 alone meant qlora
                warnings.append(f"quant: {_reason(err)}; using none")
            else:
                warnings.append(f"method: {inputs.method} does not go with these inputs ({err.field}: "
                                f"{_reason(err)}); using full")
            return replace(inputs, method=Method.FULL, quant=Quant.NONE)
    # partial checkpointing needs --grad-ckpt full (and is not modelled with an int8 base)
    err = support.first_refusal(inputs, among=("grad_ckpt", "ckpt_every", "method", "quant", "precision"))
    if err is not None and err.field == "ckpt-every":
        warnings.append(f"ckpt-every: {_reason(err)}; using 1")
        inputs = replace(inputs, ckpt_every=1)
    return inputs


def _valid_zero(gpus: int, tp: int) -> int:
    if gpus == 1 or tp == gpus:
        return 0
    return 3 if tp > 1 else 0


def _reason(err: InputError) -> str:
    prefix = f"{err.field}: "
    text = str(err)
    return text[len(prefix):] if text.startswith(prefix) else text


def _shown(value: object) -> str:
    """A fallback as a warning names it: on/off, or none for an empty text."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value) or "none"


def _show(text: str) -> str:
    """A user-supplied value, quoted and cut short, safe to put in a message."""
    return repr(text[:60] + ("…" if len(text) > 60 else ""))
