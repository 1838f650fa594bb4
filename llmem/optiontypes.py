"""What a row of the options table (`llmem.options`) is: `Option`, the option it `Needs`, its app `Widget`, and how a
value is read (a plan's coercion per kind, the module-name lists, a link's model, GPU, upload and methods)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from llmem import choices as c
from llmem.errors import InputError
from llmem.symbolic import Sym

ALL_LINEAR = "all-linear"
MAX_UPLOAD_NAME_CHARS = 80

# `cli`: where the command line takes the option
ARGUMENT = "plan"  # every plan command (`llmem.cli.add_plan_arguments`)
COMMAND = "command"  # the commands that take it, each with its own default
NO_CLI = ""
# `link`: when a share link carries it
ALWAYS, WHEN_SET, NEVER = "always", "when-set", "never"  # WHEN_SET: only off its default, so older links stay equal
# `Widget.kind`
SELECT, NUMBER, TEXT, CHECK, SPECIAL = "select", "number", "text", "check", "special"  # SPECIAL: drawn by app.py


@dataclass(frozen=True)
class Needs:
    """The option means something only when option `attr` is one of `values` (or, with `at_least`, a whole number of
    at least that): the app disables its widget and the plan gets its default otherwise. With `repair`, a link
    setting it without them falls back to the default with that warning (`{value}`: the option's value, `{other}`:
    `attr`'s)."""

    attr: str
    values: tuple[str, ...] = ()
    repair: str = ""
    at_least: int | None = None

    def holds(self, value: object) -> bool:
        """Whether `attr`'s value (typed, or as a widget or a link gives it: text) meets the need."""
        if self.at_least is None:
            return str(value) in self.values
        try:
            return int(str(value)) >= self.at_least
        except ValueError:
            return False

    def met(self, inputs: object) -> bool:
        return self.holds(getattr(inputs, self.attr))


@dataclass(frozen=True)
class Widget:
    label: str
    key: str  # its key in the app's session state
    kind: str
    step: int | float = 1
    group: str = ""  # the app's sidebar group (`llmem.ui.edits.GROUP_TITLES`); "" = drawn by another option's widget


_SAME = object()


@dataclass(frozen=True)
class Option:
    name: str
    kind: type  # int, float (a probability in [0, 1)), bool, str or a Choice enum
    default: object
    help: str
    low: int | float | None = None  # int: the plan refuses less; links and widgets take low..high
    high: int | float | None = None
    parse: Callable[[str], str] | None = None  # str: normalise, or InputError
    plan: bool = True  # a TrainingPlan field
    cli: str = ARGUMENT
    link: str = ALWAYS
    app_default: object = _SAME  # the app's and a link's default, where it differs (None: required on the CLI)
    widget: Widget | None = None
    needs: Needs | None = None
    fallback: bool = False  # a link whose plan refuses it falls back to its default, never to another strategy
    # False: valid for some strategies only, left out of the app's strategy comparison; a tuple: the values that are
    # compared (the others are left out)
    compared: bool | tuple[str, ...] = True
    cuda_only: bool = False  # needs CUDA kernels or pinned host memory: not in the CPU validation suite

    @cached_property
    def key(self) -> str:
        """`--key` on the command line, `key=` in a link, the field an error names."""
        return self.name.replace("_", "-")

    def compared_with(self, value: object) -> bool:
        """Whether the app's "compare all" keeps this value (`compared`): it runs on every strategy the plan allows."""
        return self.compared if isinstance(self.compared, bool) else str(value) in self.compared

    @cached_property
    def choice(self) -> bool:
        return issubclass(self.kind, c.Choice)

    @property
    def values(self) -> list[str]:
        return [m.value for m in self.kind] if self.choice else []

    @property
    def app_value(self) -> object:
        return self.default if self.app_default is _SAME else self.app_default

    def cli_argument(self, **default) -> dict:
        """`argparse.add_argument` keywords for `--key`: the row's default unless one is given (a row default of None:
        the option is required)."""
        if self.kind is bool:
            return {"action": "store_true", "help": self.help}
        out: dict = {"help": self.help, "default": default.get("default", self.default)}
        if not default and self.default is None:
            out = {"help": self.help, "required": True}
        if self.choice:
            out |= {"default": str(self.default), "metavar": "|".join(self.values)}
        return out

    def coerce(self, value: object) -> object:
        """`value` as a TrainingPlan stores it, or InputError naming the option."""
        return self.coercer(value)

    @cached_property
    def coercer(self) -> Callable[[object], object]:
        """`coerce` for this option's kind, made once: a plan is built several times per link decode."""
        key, kind, low = self.key, self.kind, self.low
        if self.choice:
            return lambda value: value if type(value) is kind else kind.parse(key, value)
        if kind is bool:
            return lambda value: value if type(value) is bool else as_bool(key, value)
        if kind is float:
            return lambda value: as_probability(key, value)
        if kind is int:
            def whole(value: object) -> int:
                # a Sym: the walk traced on symbols (`llmem.walk.replay`), its bound guarded by the comparison
                number = value if type(value) is int or type(value) is Sym else as_int(key, value)
                if low is not None and number < low:
                    least = "a positive whole number" if low == 1 else f"a whole number of at least {low}"
                    raise InputError(key, f"must be {least}, got {number}")
                return number
            return whole
        return self.parse or (lambda value: value)


def link_model(text: str) -> str:
    from llmem.share import check_model_name

    return check_model_name(text)


def link_gpu(text: str) -> str:
    from llmem.gpus import get_gpu

    return get_gpu(text).key


def link_upload(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._ -]", "_", text)[:MAX_UPLOAD_NAME_CHARS]


def link_methods(text: str) -> str:
    from llmem.compare import parse_methods

    return parse_methods(text)


def parse_lora_targets(value: object) -> str:
    """`all-linear` (every Linear but the output layer, as PEFT resolves it) or a comma-separated list of PEFT
    module names (a module is targeted when its name equals one or ends with "." + one). Normalised spelling."""
    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    if not isinstance(value, str):
        raise InputError("lora-targets", f"expected all-linear or a comma-separated list of names, got {value!r}")
    text = value.strip()
    if text.lower() == ALL_LINEAR:
        return ALL_LINEAR
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise InputError("lora-targets", "give all-linear or module names such as q_proj,v_proj")
    for n in names:
        if not all(part.isidentifier() or part.isdigit() for part in n.split(".")):
            raise InputError("lora-targets", f"{n!r} is not a module name (letters, digits, _ and .)")
    return ",".join(dict.fromkeys(names))


def parse_modules_to_save(value: object) -> str:
    """A comma-separated list of module names as PEFT's `modules_to_save` takes them (a module is wrapped when its
    full name ends with the name), e.g. `lm_head,embed_tokens`; empty = none. Normalised spelling."""
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    if not isinstance(value, str):
        raise InputError("lora-modules-to-save", f"expected comma-separated module names, got {value!r}")
    names = [n.strip() for n in value.split(",") if n.strip()]
    for n in names:
        if not all(part.isidentifier() or part.isdigit() for part in n.split(".")):
            raise InputError("lora-modules-to-save", f"{n!r} is not a module name (letters, digits, _ and .); "
                             "give names such as lm_head,embed_tokens")
    return ",".join(dict.fromkeys(names))


def as_bool(field: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off", ""):
        return False
    raise InputError(field, f"expected true or false, got {str(value)[:40]!r}")


def as_probability(field: str, value: object) -> float:
    try:
        p = float(value.strip() if isinstance(value, str) else value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise InputError(field, f"must be a number in [0, 1), got {value!r}") from None
    if isinstance(value, bool) or not 0.0 <= p < 1.0:
        raise InputError(field, f"must be a number in [0, 1), got {value!r}")
    return p


def as_int(field: str, value: object) -> int:
    if isinstance(value, bool):
        raise InputError(field, f"must be a whole number, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise InputError(field, f"must be a whole number, got {value!r}")
