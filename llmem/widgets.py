"""The app's widgets for the options table (`llmem.options`), without streamlit: what each widget shows and when it
is disabled, the widget values a link puts in the session, and the inputs the widgets make. `app.py` draws them.

Widgets whose kind is SPECIAL (the model source, GPU type, strategy, methods to compare) are the app's own.
"""

from __future__ import annotations

from collections.abc import Mapping

from llmem.errors import InputError
from llmem.options import ALL, BY_NAME, LINK_OPTIONS, NUMBER, SELECT, SPECIAL, TEXT, Option
from llmem.plan import Method, Quant
from llmem.share import QLORA_BASE, AppInputs

TABLE_WIDGETS: tuple[Option, ...] = tuple(o for o in LINK_OPTIONS if o.widget and o.widget.kind != SPECIAL)
WIDGET_KEYS: tuple[str, ...] = ("w_preset", "w_hub", *dict.fromkeys(o.widget.key for o in LINK_OPTIONS if o.widget))


def _state_value(option: Option, value: object) -> object:
    return value.value if option.choice else value


def state_from_inputs(inputs: AppInputs) -> dict:
    """The session values of the table's widgets, the GPU type, strategy and methods, for `inputs` (a link's)."""
    out = {o.widget.key: _state_value(o, getattr(inputs, o.name)) for o in TABLE_WIDGETS}
    out["w_gpu"] = inputs.gpu_type
    out["w_strategy"] = ALL if inputs.compare_all else f"{inputs.tp}:{inputs.zero}"
    out["w_methods"] = [m for m in inputs.methods.split(",") if m]
    return out


def _enabled(option: Option, state: Mapping) -> bool:
    needs = option.needs
    if needs is None:
        return True
    needed = BY_NAME[needs.attr]
    return needs.holds(state.get(needed.widget.key, _state_value(needed, needed.app_value)))


def widget_args(option: Option, state: Mapping) -> dict:
    """Keyword arguments of the streamlit call that draws `option`'s widget (the call is chosen by its kind)."""
    widget = option.widget
    args = {"label": widget.label, "key": widget.key, "help": option.help, "disabled": not _enabled(option, state)}
    if widget.kind == SELECT:
        args["options"] = option.values
    elif widget.kind == NUMBER:
        args |= {"min_value": option.low, "max_value": option.high, "step": widget.step}
    return args


def text_error(option: Option, state: Mapping) -> str:
    """A typed text (module names) the library refuses: the message and the default used instead; "" when valid."""
    try:
        option.parse(state.get(option.widget.key, option.app_value))
    except InputError as err:
        return f"{err}; using {option.app_value or 'none'}"
    return ""


def _read(option: Option, raw: object) -> object:
    if option.choice:
        return option.kind(raw)
    if option.widget.kind == TEXT:
        try:
            return option.parse(raw)
        except InputError:
            return option.app_value
    return option.kind(raw)


def inputs_from_state(state: Mapping, model: str, upload: str) -> AppInputs:
    """The inputs the widgets make: each option's widget value, or its default where it has no meaning (LoRA's
    options under full fine-tuning, ckpt-every without grad-ckpt full, ...); qlora without a base gets nf4."""
    values: dict[str, object] = {}
    for option in TABLE_WIDGETS:
        raw = state.get(option.widget.key)
        value = option.app_value if raw is None else _read(option, raw)
        if option.needs is not None and not option.needs.holds(values.get(option.needs.attr)):
            value = option.app_value
        if option.name == "quant" and values["method"] is Method.QLORA and value is Quant.NONE:
            value = QLORA_BASE
        values[option.name] = value
    strategy = state.get("w_strategy", ALL)
    tp, zero = (1, ALL) if strategy == ALL else map(int, strategy.split(":"))
    return AppInputs(model=model, gpu_type=state["w_gpu"], tp=tp, zero=zero, upload=upload,
                     methods=",".join(sorted(state.get("w_methods", []))), **values)
