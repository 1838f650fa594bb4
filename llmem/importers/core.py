"""What an import produces, and the reader each format fills it through.

A format module reads one parsed file through a `Reader`: `set` maps a key to an option of `llmem.options` (the value
checked by the option's own coercion, an error naming the file and key), `ignore` says why a key is not used, `auto`
records a DeepSpeed `"auto"` that the HF Trainer fills from another file, `engine` maps a key that selects another
engine's program (DeepSpeed ZeRO, FSDP1) only when the user asked for the nearest PyTorch program (`--engine torch`).
Top-level keys no reader looked at are listed once, as having no effect on memory or as not recognised.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from llmem.errors import InputError
from llmem.options import BY_NAME

AUTO = "auto"
NO_VALUE = ...  # an ignored line about several keys shows no value
MAX_TEXT = 200  # longer strings are not option values
MAX_MAGNITUDE = 10**12  # larger numbers are refused before any option sees them
MAX_LISTED = 24
LIST_OPTIONS = ("lora_targets", "lora_modules_to_save")  # the options a list of names sets
_MISSING = object()

# keys of every trainer format that change nothing in the per-GPU peak
NO_EFFECT = frozenset("""
learning_rate lr num_train_epochs num_epochs epochs max_steps warmup_steps warmup_ratio lr_scheduler_type lr_scheduler
weight_decay adam_beta1 adam_beta2 adam_epsilon max_grad_norm gradient_clipping seed data_seed logging_steps
logging_dir logging_strategy logging_first_step save_steps save_strategy save_total_limit save_only_model eval_steps
eval_strategy evaluation_strategy per_device_eval_batch_size eval_batch_size output_dir overwrite_output_dir run_name
report_to push_to_hub hub_model_id hub_strategy resume_from_checkpoint do_train do_eval do_predict dataset
dataset_dir datasets dataset_text_field dataset_prepared_path val_set_size val_size template max_samples
preprocessing_num_workers dataloader_num_workers dataloader_pin_memory overwrite_cache ddp_timeout plot_loss
wandb_project wandb_entity wandb_watch wandb_name wandb_log_model special_tokens chat_template tokenizer_type
model_type trust_remote_code strict debug logging_nan_inf_filter disable_tqdm remove_unused_columns label_names
group_by_length train_on_inputs evals_per_epoch saves_per_epoch eval_table_size early_stopping_patience
tf32 local_rank include_tokens_per_second neftune_noise_alpha dataset_num_proc shuffle log_every_n_steps
metric_logger output_dir lr_scheduler_kwargs optim_args save_safetensors load_best_model_at_end metric_for_best_model
""".split())


def short(value: object) -> str:
    """The file's value in a report line, bounded whatever the file holds."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        digits = int(value.bit_length() * 0.30103) + 1  # str() of a huge int may raise (Python's digit limit)
        return str(value) if abs(value) < 10**30 else f"a number of about {digits} digits"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return repr(value) if len(value) <= 60 else repr(value[:57] + "...")
    if isinstance(value, (list, tuple)):
        if len(value) <= 8 and all(isinstance(v, (str, int, float)) and len(str(v)) < 40 for v in value):
            return "[" + ", ".join(short(v) for v in value) + "]"
        return f"a list of {len(value)} items"
    if isinstance(value, dict):
        return f"a mapping of {len(value)} keys"
    return f"a {type(value).__name__}"


@dataclass(frozen=True)
class Line:
    """One line of the report: `key` of `file` (its value as `value`), the option it sets and the setting (used and
    default lines), and why (a note on a used line, the reason on an ignored one)."""

    file: str
    key: str
    value: str = ""
    option: str = ""
    setting: object = None
    why: str = ""

    def to_dict(self) -> dict:
        setting = self.setting if isinstance(self.setting, (bool, int, float, type(None))) else str(self.setting)
        return {"file": self.file, "key": self.key, "value": self.value, "option": self.option, "setting": setting,
                "why": self.why}


@dataclass
class ImportResult:
    """What the files determine: `options` (TrainingPlan field names and option names → values as the plan takes
    them), `used` lines (file, key → option = value), `ignored` lines (and why), `defaults` (options no file set,
    each with its default), and the `files` read with their detected format."""

    options: dict = field(default_factory=dict)
    used: list[Line] = field(default_factory=list)
    ignored: list[Line] = field(default_factory=list)
    defaults: list[Line] = field(default_factory=list)
    files: list[tuple[str, str]] = field(default_factory=list)
    model_autos: list[Line] = field(default_factory=list)  # "auto"s the Trainer fills from the model's config

    def fill_from_model(self, hidden_size: int) -> None:
        """Each "auto" the Trainer fills from the model, once the model is known (transformers
        integrations/deepspeed.py `trainer_config_finalize`, :232-242: `reduce_bucket_size` = h², ZeRO-3's
        `stage3_prefetch_bucket_size` = int(0.9 h²) and `stage3_param_persistence_threshold` = 10 h)."""
        h = hidden_size
        fills = {"ds_prefetch_bucket": (int(0.9 * h * h), f"0.9 × hidden_size² (0.9 × {h}²)"),
                 "ds_persistence_threshold": (10 * h, f"10 × hidden_size (10 × {h})")}
        for auto in self.model_autos:
            number, formula = fills.get(auto.option, (h * h, f"hidden_size² ({h}²)"))
            value = BY_NAME[auto.option].coerce(number)
            self.options[auto.option] = value
            self.used.append(Line(auto.file, auto.key, auto.value, auto.option, value,
                                  f"the model's {formula}, as the HF Trainer fills it"))
            self.defaults = [x for x in self.defaults if x.option != auto.option]
        self.model_autos = []

    def source(self, option: str) -> Line | None:
        """The used line that set `option`."""
        return next((line for line in self.used if line.option == option), None)

    def to_dict(self) -> dict:
        return {"files": [{"file": f, "format": fmt} for f, fmt in self.files],
                "options": {k: v if isinstance(v, (bool, int, float)) else str(v) for k, v in self.options.items()},
                "used": [x.to_dict() for x in self.used], "ignored": [x.to_dict() for x in self.ignored],
                "defaults": [x.to_dict() for x in self.defaults]}

    def link_query(self) -> dict[str, str]:
        """The options the files set as a share link's query (`{key: text}`): the app passes it to
        `llmem.share.decode` with its current inputs, which checks and repairs it as it does a link."""
        from llmem.options import LINK_OPTIONS

        keys = {o.name: o.key for o in LINK_OPTIONS}
        return {keys[k]: str(v).lower() if isinstance(v, bool) else str(v) for k, v in self.options.items()
                if k in keys}

    def lines(self) -> list[str]:
        from llmem.importers.report import report_lines

        return report_lines(self)


def scalar(name: str, key: str, value: object) -> object:
    """`value` if an option may take it (a short string, a bounded number, a bool, a list of short strings)."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float)):
        if not abs(value) <= MAX_MAGNITUDE:  # also NaN
            raise InputError(f"{name}: {key}", f"{short(value)} is out of range")
        return value
    if isinstance(value, str):
        if len(value) > MAX_TEXT:
            raise InputError(f"{name}: {key}", f"a string of {len(value):,} characters is not a value of this key")
        return value
    if isinstance(value, (list, tuple)) and len(value) <= 256 and all(isinstance(v, str) for v in value):
        return [scalar(name, key, v) for v in value]
    raise InputError(f"{name}: {key}", f"expected a value, got {short(value)}")


class Reader:
    """One file's tree and what the format module made of it."""

    def __init__(self, name: str, tree: dict, engine_torch: bool = False, prefix: str = ""):
        self.name, self.tree, self.engine_torch, self.prefix = name, tree, engine_torch, prefix
        self.options: dict = {}
        self.used: list[Line] = []
        self.ignored: list[Line] = []
        self.autos: list[Line] = []
        self.seen: set = set()
        self.no_sync: Line | None = None  # a Trainer file's --no-sync (`importers.no_sync.hint`)

    def nested(self, key: str, tree: dict) -> Reader:
        """A reader of a section (an inline DeepSpeed config) whose lines go into this one's."""
        sub = Reader(self.name, tree, self.engine_torch, f"{self.prefix}{key}.")
        sub.options, sub.used, sub.ignored, sub.autos = self.options, self.used, self.ignored, self.autos
        return sub

    def get(self, path: str, default: object = None) -> object:
        """The value at dotted `path` (None and missing alike give `default`); marks its top-level key read."""
        node: object = self.tree
        parts = path.split(".")
        self.seen.add(parts[0])
        for part in parts:
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return default if node is None else node

    def has(self, path: str) -> bool:
        return self.get(path, _MISSING) is not _MISSING

    def copy(self, pairs: tuple[tuple[str, str], ...], prefix: str = "") -> None:
        """Each (key, option) whose key the file sets: the option takes the value as given (`set` checks it)."""
        for key, option in pairs:
            if self.has(prefix + key):
                self.set(prefix + key, option, self.get(prefix + key))

    def section(self, path: str) -> dict:
        value = self.get(path, {})
        if not isinstance(value, dict):
            raise InputError(f"{self.name}: {self.prefix}{path}", f"expected a mapping, got {short(value)}")
        return value

    def flag(self, path: str) -> bool | str | None:
        """A true/false key: True, False, AUTO or None (absent); "true"/"false" strings are taken."""
        value = self.get(path)
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false", AUTO):
            text = value.strip().lower()
            return AUTO if text == AUTO else text == "true"
        raise InputError(f"{self.name}: {self.prefix}{path}", f"expected true or false, got {short(value)}")

    def text(self, path: str) -> str | None:
        value = self.get(path)
        if value is None or isinstance(value, str):
            return scalar(self.name, self.prefix + path, value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(scalar(self.name, self.prefix + path, value))
        raise InputError(f"{self.name}: {self.prefix}{path}", f"expected a name, got {short(value)}")

    def set(self, path: str, option: str, value: object, why: str = "", shown: object = _MISSING) -> None:
        """Map `path` to `option` = `value` (checked by the option's coercion; an error names the file and key)."""
        key = self.prefix + path
        value = scalar(self.name, key, value)
        if isinstance(value, list) and option not in LIST_OPTIONS:
            raise InputError(f"{self.name}: {key}", f"expected one value, got {short(value)}")
        try:
            setting = BY_NAME[option].coerce(value)
        except InputError as e:
            raise InputError(f"{self.name}: {key}", str(e).split(": ", 1)[-1]) from None
        self.options[option] = setting
        self.used[:] = [line for line in self.used if line.option != option]  # a later key of the file wins
        file_value = self.get(path) if shown is _MISSING else shown
        self.used.append(Line(self.name, key, short(file_value), option, setting, why))

    def ignore(self, path: str, why: str, value: object = _MISSING) -> None:
        shown = self.get(path) if value is _MISSING else value
        self.ignored.append(Line(self.name, self.prefix + path, "" if shown is NO_VALUE else short(shown), why=why))

    def auto(self, path: str, option: str, source: str, shown: str = "'auto'") -> None:
        """`path` is "auto" (or absent, `shown`): the launcher fills it from its `source` (another file may give
        it)."""
        self.seen.add(path.split(".")[0])
        self.autos.append(Line(self.name, self.prefix + path, shown, option, None, source))

    def engine(self, path: str, option: str, value: object, engine: str, nearest: str, part: str = "") -> None:
        """A key that selects `engine`'s own program (`part` of it): mapped to the nearest PyTorch one only with
        --engine torch."""
        if self.engine_torch:
            self.set(path, option, value, f"nearest PyTorch program to {engine} (--engine torch): {nearest}")
        else:
            what = f"the {engine} engine's {part} is" if part else f"the {engine} engine is"
            self.ignore(path, f"{what} not modelled yet; add --engine torch to estimate the nearest "
                        f"PyTorch program ({nearest})")
            self.ignored[-1] = replace(self.ignored[-1], option=option)  # the option it would set

    def finish(self, no_effect: frozenset = frozenset()) -> None:
        """One line for the top-level keys nobody read: those with no effect on memory, and the unknown ones (keys
        left empty set nothing and are not listed)."""
        rest = [k for k, v in self.tree.items() if k not in self.seen and v is not None]  # a null key sets nothing
        quiet = [self.prefix + str(k) for k in rest if k in NO_EFFECT or k in no_effect]
        unknown = [self.prefix + str(k)[:60] for k in rest if not (k in NO_EFFECT or k in no_effect)]
        if quiet:
            self.ignored.append(Line(self.name, _listed(quiet), why="no effect on per-GPU memory"))
        if unknown:
            self.ignored.append(Line(self.name, _listed(unknown), why="not read: not a key llmem maps "
                                     "(docs/IMPORT.md lists the keys read)"))


def _listed(keys: list[str]) -> str:
    more = len(keys) - MAX_LISTED
    return ", ".join(keys[:MAX_LISTED]) + (f" and {more} more" if more > 0 else "")
