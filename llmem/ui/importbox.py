"""The app's "Import training configs" box: uploaded DeepSpeed / accelerate / Trainer / PEFT / axolotl /
LLaMA-Factory / torchtune files (`llmem.importers`, the same reading as `llmem estimate --from`) turned into the
page's inputs. The files' options are laid over the current inputs as a share link's values would be, and checked
and repaired the same way (`llmem.share.decode`); the report (used, ignored and why, defaults) and any repair are
the notes shown after the import."""

from __future__ import annotations

from collections.abc import Iterable

from llmem import share


def imported_inputs(files: Iterable[tuple[bytes, str]], engine_torch: bool,
                    current: share.AppInputs) -> tuple[share.AppInputs, list[str]]:
    """(the inputs after the import, the notes to show). InputError (naming the file and key) for a file that
    cannot be read."""
    from llmem.importers import import_uploads

    result = import_uploads(files, engine_torch)
    _fill_from_preset(result, str(result.options.get("model") or current.model))
    query = share.encode(current) | result.link_query()
    inputs, warnings = share.decode(query, current)
    return inputs, [line.strip() for line in result.lines()] + warnings


def _fill_from_preset(result, model: str) -> None:  # noqa: ANN001
    """The "auto"s the Trainer fills from the model (DeepSpeed's reduce_bucket_size = hidden_size²) when the model
    is a preset (the app opens nothing else to fill them)."""
    from llmem.presets import find_preset, load_preset
    from llmem.spec import ModelSpec

    if result.model_autos and find_preset(model) is not None:
        result.fill_from_model(ModelSpec.from_config(load_preset(find_preset(model).name)).hidden_size)
