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
from dataclasses import dataclass, fields, replace

from llmem.compare import parse_methods
from llmem.errors import InputError
from llmem.gpus import get_gpu
from llmem.plan import (
    MAX_TOKENS,
    Attention,
    FsdpShard,
    GradCkpt,
    Loss,
    Method,
    Offload,
    Optimizer,
    OptimizerImpl,
    Precision,
    Quant,
    TrainingPlan,
    parse_lora_targets,
    parse_modules_to_save,
)

ALL = "all"  # zero=all: compare every strategy for the GPU count and show the recommended one
MAX_APP_GPUS = 4096
MAX_APP_BATCH = 4096
MAX_APP_CKPT_EVERY = 1024
MAX_APP_LORA_RANK = 4096
MAX_APP_GRAD_ACCUM = 1024
MAX_MODEL_CHARS = 200
MAX_UPLOAD_NAME_CHARS = 80

# One path-free part of a model name: what Hugging Face allows in an org or repo name.
_NAME_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
_MODEL_RE = re.compile(rf"{_NAME_PART}(/{_NAME_PART})?")
_FILE_SUFFIXES = (".json", ".yaml", ".yml", ".txt", ".py", ".bin", ".safetensors", ".gguf", ".pt", ".pth")


@dataclass(frozen=True)
class AppInputs:
    """Everything the app's view depends on. `zero` is 0-3, or "all" to compare every strategy."""

    model: str = "llama-3.1-8b"
    gpu_type: str = "a100-80gb"
    gpus: int = 1
    tp: int = 1
    zero: int | str = ALL
    batch_size: int = 1
    seq_len: int = 2048
    precision: Precision = Precision.BF16_MIXED
    optimizer: Optimizer = Optimizer.ADAMW
    optimizer_impl: OptimizerImpl = OptimizerImpl.DEFAULT
    grad_ckpt: GradCkpt = GradCkpt.NONE
    attn: Attention = Attention.SDPA
    quant: Quant = Quant.NONE  # nf4/fp4/int8: the quantized base of --method qlora; none otherwise
    offload: Offload = Offload.NONE
    loss: Loss = Loss.STANDARD
    upload: str = ""  # display name of an uploaded config.json (the file itself never travels)
    ckpt_every: int = 1  # with grad_ckpt full: checkpoint decoder layers 0, K, 2K, ...
    methods: str = ""  # other fine-tuning methods shown beside the plan's strategies, e.g. "lora,qlora"
    method: Method = Method.FULL  # full / lora / qlora (a link with quant nf4/fp4 and no method means qlora)
    lora_rank: int = 16  # with lora/qlora
    lora_targets: str = "all-linear"  # with lora/qlora
    grad_accum: int = 1  # micro-steps per optimizer step
    lora_modules_to_save: str = ""  # with lora/qlora: PEFT modules_to_save, e.g. "lm_head"
    double_quant: bool = False  # with a 4-bit qlora base: bitsandbytes' nested quantization of the block scales
    fsdp_shard: FsdpShard = FsdpShard.DIM0  # FSDP2 (ZeRO-2/3): Shard(1) for tensors with fewer rows than ranks

    def __post_init__(self) -> None:
        if self.quant is not Quant.NONE and self.method is Method.FULL:  # a 4-bit base alone has always meant qlora
            object.__setattr__(self, "method", Method.QLORA)

    @property
    def compare_all(self) -> bool:
        return self.zero == ALL

    def to_plan(self) -> TrainingPlan:
        """The plan to estimate. With zero=all this is the data-parallel base plan that `compare` varies."""
        tp, zero = (1, 0) if self.compare_all else (self.tp, int(self.zero))
        return TrainingPlan(
            gpus=self.gpus, tp=tp, zero=zero, batch_size=self.batch_size, seq_len=self.seq_len,
            precision=self.precision, optimizer=self.optimizer, optimizer_impl=self.optimizer_impl,
            grad_ckpt=self.grad_ckpt, attn=self.attn, ckpt_every=self.ckpt_every,
            method=self.method, quant=self.quant, lora_rank=self.lora_rank, lora_targets=self.lora_targets,
            grad_accum=self.grad_accum, offload=self.offload, loss=self.loss,
            lora_modules_to_save=self.lora_modules_to_save if self.method is not Method.FULL else "",
            double_quant=self.double_quant and self.quant in (Quant.NF4, Quant.FP4),
            fsdp_shard=self.fsdp_shard,
        )

    def with_(self, **changes) -> AppInputs:
        return replace(self, **changes)


# attribute -> query key (the command-line option name, so the URL reads like the CLI)
KEYS: dict[str, str] = {
    "model": "model",
    "gpu_type": "gpu-type",
    "gpus": "gpus",
    "tp": "tp",
    "zero": "zero",
    "batch_size": "batch-size",
    "seq_len": "seq-len",
    "precision": "precision",
    "optimizer": "optimizer",
    "optimizer_impl": "optimizer-impl",
    "grad_ckpt": "grad-ckpt",
    "attn": "attn",
    "quant": "quant",
    "offload": "offload",
    "loss": "loss",
    "upload": "upload",
    "ckpt_every": "ckpt-every",
    "methods": "methods",
    "method": "method",
    "lora_rank": "lora-rank",
    "lora_targets": "lora-targets",
    "grad_accum": "grad-accum",
    "lora_modules_to_save": "lora-modules-to-save",
    "double_quant": "double-quant",
    "fsdp_shard": "fsdp-shard",
}
_ATTR = {v: k for k, v in KEYS.items()}
_ENUMS = {
    "precision": Precision,
    "optimizer": Optimizer,
    "optimizer_impl": OptimizerImpl,
    "grad_ckpt": GradCkpt,
    "attn": Attention,
    "quant": Quant,
    "offload": Offload,
    "loss": Loss,
    "method": Method,
    "fsdp_shard": FsdpShard,
}
_INT_RANGES = {"gpus": (1, MAX_APP_GPUS), "tp": (1, MAX_APP_GPUS), "batch_size": (1, MAX_APP_BATCH),
               "seq_len": (1, MAX_TOKENS), "ckpt_every": (1, MAX_APP_CKPT_EVERY),
               "lora_rank": (1, MAX_APP_LORA_RANK), "grad_accum": (1, MAX_APP_GRAD_ACCUM)}
# written into a link only when they differ from their default, so that older links stay equal to new ones
_ONLY_WHEN_SET = ("upload", "ckpt_every", "methods", "method", "lora_rank", "lora_targets", "grad_accum",
                  "lora_modules_to_save", "double_quant", "fsdp_shard")


def encode(inputs: AppInputs) -> dict[str, str]:
    """Every input as `{query key: value}`; `upload`, `ckpt-every`, `methods`, `method`, `lora-rank`,
    `lora-targets`, `grad-accum` and `lora-modules-to-save` only when they differ from their defaults."""
    out = {}
    for f in fields(inputs):
        value = getattr(inputs, f.name)
        if f.name in _ONLY_WHEN_SET and value == f.default:
            continue
        out[KEYS[f.name]] = str(value).lower() if isinstance(value, bool) else str(value)
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
        attr = _ATTR.get(str(key))
        if attr is None:
            warnings.append(f"unknown link parameter {_show(str(key))} ignored")
            continue
        text = str(raw).strip()
        try:
            values[attr] = _parse(attr, text)
        except InputError as err:
            warn(attr, _reason(err))
    implied = "method" not in values and values.get("quant", Quant.NONE) is not Quant.NONE  # an older link
    if values.get("method") is Method.FULL and values.get("quant", Quant.NONE) is not Quant.NONE:
        warnings.append(f"quant: {values['quant']} is the quantized base of --method qlora, not of full; using none")
        values["quant"] = Quant.NONE
    inputs = replace(defaults, **values)
    inputs = _make_consistent(inputs, defaults, warnings, method_implied=implied, quant_given="quant" in values)
    return inputs, warnings


def _parse(attr: str, text: str) -> object:
    field = KEYS[attr]
    if attr == "model":
        return check_model_name(text)
    if attr == "upload":
        name = re.sub(r"[^A-Za-z0-9._ -]", "_", text)[:MAX_UPLOAD_NAME_CHARS]
        return name
    if attr == "gpu_type":
        return get_gpu(text).key
    if attr == "methods":
        return parse_methods(text[:MAX_MODEL_CHARS])
    if attr == "lora_targets":
        return parse_lora_targets(text[:MAX_MODEL_CHARS])
    if attr == "lora_modules_to_save":
        return parse_modules_to_save(text[:MAX_MODEL_CHARS])
    if attr == "double_quant":
        if text.lower() not in ("true", "false"):
            raise InputError(field, f"{_show(text)} is not true or false")
        return text.lower() == "true"
    if attr in _ENUMS:
        return _ENUMS[attr].parse(field, text)
    if attr == "zero" and text.lower() == ALL:
        return ALL
    if not re.fullmatch(r"[0-9]{1,9}", text):
        raise InputError(field, f"{_show(text)} is not a whole number")
    number = int(text)
    if attr == "zero":
        if number not in (0, 1, 2, 3):
            raise InputError(field, f"{number} is not 0, 1, 2, 3 or all")
        return number
    low, high = _INT_RANGES[attr]
    if not low <= number <= high:
        raise InputError(field, f"{number} is outside {low}..{high}")
    return number


def _make_consistent(inputs: AppInputs, defaults: AppInputs, warnings: list[str], *, method_implied: bool = False,
                     quant_given: bool = True) -> AppInputs:
    """Fix combinations that are each valid alone but not together (TP vs GPU count, tokens per GPU, a
    fine-tuning method and the strategy or precision it is not modelled with)."""
    if inputs.batch_size * inputs.seq_len > MAX_TOKENS:
        warnings.append(f"batch-size: {inputs.batch_size} × seq-len {inputs.seq_len} exceeds {MAX_TOKENS:,} "
                        f"tokens per GPU; using batch-size 1")
        inputs = replace(inputs, batch_size=1)
    if inputs.ckpt_every > 1 and inputs.grad_ckpt is not GradCkpt.FULL:
        warnings.append(f"ckpt-every: {inputs.ckpt_every} needs grad-ckpt full; using 1")
        inputs = replace(inputs, ckpt_every=1)
    if inputs.tp > inputs.gpus or inputs.gpus % inputs.tp:
        warnings.append(f"tp: {inputs.tp} does not divide gpus {inputs.gpus}; using 1")
        inputs = replace(inputs, tp=1)
    try:  # an optimizer and an implementation that never go together (adafactor + fused), whatever the strategy
        TrainingPlan(optimizer=inputs.optimizer, optimizer_impl=inputs.optimizer_impl)
    except InputError as err:
        warnings.append(f"{err.field}: {_reason(err)}; using {OptimizerImpl.DEFAULT}")
        inputs = replace(inputs, optimizer_impl=OptimizerImpl.DEFAULT)
    inputs = _consistent_method(inputs, warnings, method_implied, quant_given)
    if inputs.double_quant and inputs.quant not in (Quant.NF4, Quant.FP4):
        warnings.append("double-quant: double quantization goes with a 4-bit qlora base (--quant nf4/fp4); using off")
        inputs = replace(inputs, double_quant=False)
    if inputs.lora_modules_to_save and inputs.method is Method.FULL:
        warnings.append("lora-modules-to-save: trainable module copies go with --method lora/qlora; using none")
        inputs = replace(inputs, lora_modules_to_save="")
    # options valid for some strategies only: never traded for a strategy change
    for attr in ("offload", "loss", "lora_modules_to_save"):
        try:
            inputs.to_plan()
            if inputs.compare_all and attr != "lora_modules_to_save" \
                    and getattr(inputs, attr) is not getattr(defaults, attr) and inputs.gpus > 1:
                raise InputError(KEYS[attr], "compare-all varies the strategy; pick one strategy for this option")
        except InputError as err:
            if err.field == KEYS[attr]:
                warnings.append(f"{err.field}: {_reason(err)}; using {str(getattr(defaults, attr)) or 'none'}")
                inputs = replace(inputs, **{attr: getattr(defaults, attr)})
    for _ in range(6):
        try:
            inputs.to_plan()
            return inputs
        except InputError as err:
            # e.g. adafactor with FSDP2, a fused impl; an option valid only on the strategy the link no longer has
            if err.field in ("optimizer", "optimizer-impl", "offload", "loss", "lora-modules-to-save"):
                attr = err.field.replace("-", "_")
                fallback = getattr(AppInputs(), attr)
                warnings.append(f"{err.field}: {_reason(err)}; using {fallback!s}" if fallback else
                                f"{err.field}: {_reason(err)}; using none")
                inputs = replace(inputs, **{attr: fallback})
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
        inputs = replace(inputs, quant=Quant.NF4)  # the app's default base for qlora
    if inputs.method is not Method.QLORA and inputs.quant is not Quant.NONE:
        warnings.append(f"quant: {inputs.quant} is the quantized base of --method qlora, not of {inputs.method}; "
                        "using none")
        inputs = replace(inputs, quant=Quant.NONE)
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
    try:  # partial checkpointing needs --grad-ckpt full
        TrainingPlan(grad_ckpt=inputs.grad_ckpt, ckpt_every=inputs.ckpt_every, method=inputs.method,
                     quant=inputs.quant, precision=inputs.precision)
    except InputError as err:
        if err.field == "ckpt-every":
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


def _show(text: str) -> str:
    """A user-supplied value, quoted and cut short, safe to put in a message."""
    return repr(text[:60] + ("…" if len(text) > 60 else ""))
