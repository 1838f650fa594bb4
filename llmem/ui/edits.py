"""What the app does around one widget change, without streamlit: the obvious fixes it applies to the other widgets
(with a note saying so), the widget an error belongs next to, the sidebar's groups, and the plan the first view
opens on.

The session state is a plain mapping of widget keys (`llmem.widgets`) to widget values; `on_edit` changes it in
place, as a streamlit `on_change` callback may, and returns the notes to show.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, MutableMapping

from llmem.makefit import pure_precision
from llmem.options import ALL, BY_NAME, GROUP_TITLES, LINK_OPTIONS, OPTIONS, SPECIAL
from llmem.plan import Loss, Method, Offload, Precision, Quant
from llmem.share import QLORA_BASE

# The first view when a visitor opens the app without a link: a plan people run that fits (LoRA r=16 on
# llama-3.1-8b in bf16 on one A100 80GB). A link without `method` still means full fine-tuning: only an empty
# query string opens on this.
STARTER = {"model": "llama-3.1-8b", "gpu-type": "a100-80gb", "gpus": "1", "zero": "all", "method": "lora",
           "precision": "bf16"}

# The sidebar's groups, in order: (title, option names in the options table's order), from each widget's group
# (`Widget.group`). "model" is the model source; "methods" the other methods to compare.
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = tuple(
    (title, tuple(o.name for o in OPTIONS if o.widget and o.widget.group == title)) for title in GROUP_TITLES)

# an error's field (the command-line name) -> the widget it is shown under
FIELD_WIDGET: dict[str, str] = {o.key: o.widget.key for o in LINK_OPTIONS if o.widget}
FIELD_WIDGET |= {"model": "w_source", "upload": "w_source", "tp": "w_strategy", "zero": "w_strategy",
                 "device": "w_source", "config": "w_source"}


_OPTION_FLAG = re.compile(r"--([a-z][a-z0-9-]*)")
_LABELS = {o.key: o.widget.label for o in LINK_OPTIONS if o.widget} | {"tp": "Strategy", "zero": "Strategy"}


def app_words(message: str) -> str:
    """A library message in the app's words: each command-line option (`--precision`) becomes the label of its
    widget ("Precision")."""
    return _OPTION_FLAG.sub(lambda m: f"“{_LABELS[m.group(1)]}”" if m.group(1) in _LABELS else m.group(0), message)


def widget_for(field: str) -> str:
    """The widget an error naming `field` is shown under; the model's (a config.json field such as hidden_size or
    model_type, or anything else) when no widget sets it."""
    return FIELD_WIDGET.get(field, "w_source")


def group_of(option_name: str) -> str:
    return next(title for title, names in GROUPS if option_name in names)


def _strategy_label(tp: int, zero: int) -> str:
    return f"TP {tp}, ZeRO {zero}"


def _method_edited(state: MutableMapping) -> list[str]:
    notes = []
    method = state.get("w_method")
    if method == Method.QLORA.value:
        if state.get("w_quant", Quant.NONE.value) == Quant.NONE.value:
            state["w_quant"] = QLORA_BASE.value
            notes.append(f"QLoRA quantized base set to {QLORA_BASE}")
        precision = Precision(state.get("w_precision", Precision.BF16_MIXED.value))
        if precision.is_mixed:
            state["w_precision"] = pure_precision(precision).value
            notes.append(f"precision {precision} → {pure_precision(precision)}: QLoRA recipes build the base in its "
                         "compute dtype")
        if state.get("w_quant") == Quant.INT8.value and int(state.get("w_gpus", 1)) > 1:
            state["w_quant"] = QLORA_BASE.value
            notes.append(f"QLoRA base int8 → {QLORA_BASE}: the 8-bit base is modelled on one GPU")
    else:
        state["w_quant"] = Quant.NONE.value
    strategy = state.get("w_strategy", ALL)
    if method != Method.FULL.value and strategy != ALL and int(strategy.split(":")[0]) > 1:
        state["w_strategy"] = ALL
        notes.append(f"strategy {_strategy_label(*map(int, strategy.split(':')))} → compare all: {method} does not "
                     "run with tensor parallelism")
    if method != Method.FULL.value and state.get("w_offload", Offload.NONE.value) == Offload.OPTIMIZER.value:
        state["w_offload"] = Offload.NONE.value
        notes.append(f"offload optimizer → none: optimizer offload is modelled for full fine-tuning ({method}'s "
                     "adapter states are a few MB)")
    return notes


def _one_strategy_options(state: MutableMapping, key: str) -> list[str]:
    """Offload and the fused loss are not varied by "compare all" on several GPUs: pick the strategy they run on."""
    notes = []
    gpus = int(state.get("w_gpus", 1))
    offload = state.get("w_offload", Offload.NONE.value)
    if gpus > 1 and offload == Offload.OPTIMIZER.value:
        state["w_offload"] = offload = Offload.OPTIMIZER_PARAMS.value
        notes.append("offload optimizer → optimizer+params: torchao's optimizer offload is single-GPU; FSDP2's "
                     "CPU offload is its form on several GPUs")
    if gpus == 1 and offload == Offload.OPTIMIZER_PARAMS.value:
        state["w_offload"] = offload = Offload.OPTIMIZER.value
        notes.append("offload optimizer+params → optimizer: FSDP2's CPU offload needs 2+ GPUs; torchao's optimizer "
                     "offload is its one-GPU form")
    strategy = state.get("w_strategy", ALL)
    if gpus == 1:
        return notes
    fused = state.get("w_loss", Loss.STANDARD.value) == Loss.FUSED_LINEAR_CE.value
    if key == "w_strategy":  # the strategy was chosen: what does not run on it goes
        if offload == Offload.OPTIMIZER_PARAMS.value and strategy not in ("1:2", "1:3"):
            state["w_offload"] = Offload.NONE.value
            notes.append(f"offload optimizer+params → none: it runs on FSDP2 (ZeRO-2/3), one strategy, not "
                         f"{_shown(strategy)}")
        elif fused and strategy not in ("1:0", "1:1"):
            state["w_loss"] = Loss.STANDARD.value
            notes.append(f"loss fused-linear-ce → standard: it is modelled on DDP and ZeRO-1, one strategy, not "
                         f"{_shown(strategy)}")
        return notes
    if offload == Offload.OPTIMIZER_PARAMS.value and strategy not in ("1:2", "1:3"):
        state["w_strategy"] = "1:3"
        notes.append(f"strategy {_shown(strategy)} → ZeRO-3: offload optimizer+params runs on FSDP2 (ZeRO-2/3) with "
                     "TP 1")
    elif offload == Offload.NONE.value and fused and strategy not in ("1:0", "1:1"):
        state["w_strategy"] = "1:1"
        notes.append(f"strategy {_shown(strategy)} → ZeRO-1: the fused loss is modelled on one GPU, DDP and ZeRO-1")
    return notes


def _shown(strategy: str) -> str:
    return "compare all" if strategy == ALL else _strategy_label(*map(int, strategy.split(":")))


def on_edit(state: MutableMapping, key: str) -> list[str]:
    """The widget `key` was changed by the user: apply the obvious fixes to the others; the notes saying what changed.
    A combination with no obvious fix is left as it is (its error is shown next to the field)."""
    notes = _method_edited(state) if key == "w_method" else []
    if key in ("w_gpus", "w_offload", "w_loss", "w_strategy", "w_method"):
        notes += _one_strategy_options(state, key)
    return notes


def strategy_or_all(state: MutableMapping, valid: Mapping[str, str]) -> str:
    """The strategy widget's value if it is one of `valid` (value -> label), else "all" with a note."""
    wanted = state.get("w_strategy", ALL)
    if wanted in valid:
        return ""
    state["w_strategy"] = ALL
    tp, zero = wanted.split(":")
    return (f"strategy {_strategy_label(int(tp), int(zero))} → compare all: not valid for this model on "
            f"{state.get('w_gpus', 1)} GPU(s)")


def differs_from_default(state: Mapping, names: tuple[str, ...]) -> bool:
    """Whether any of these options' widgets holds a value other than its default (its group opens)."""
    for name in names:
        option = BY_NAME.get(name)
        if option is None or option.widget is None or option.widget.kind == SPECIAL or option.widget.key not in state:
            continue
        default = option.app_value.value if option.choice else option.app_value
        if state[option.widget.key] != default:
            return True
    return False
