"""The import report as text: one line per key used (file: key = value → --option value), per key ignored (and
why), and the options left at their defaults."""

from __future__ import annotations

from llmem.importers.core import ImportResult, Line
from llmem.options import BY_NAME


def setting(line: Line) -> str:
    value = line.setting
    return str(value).lower() if isinstance(value, bool) else str(value) if value != "" else "''"


def option_text(line: Line) -> str:
    return f"--{BY_NAME[line.option].key} {setting(line)}"


def report_lines(result: ImportResult) -> list[str]:
    out = [f"read {name} as {fmt}" for name, fmt in result.files]
    for line in result.used:
        why = f"  ({line.why})" if line.why else ""
        out.append(f"  used     {line.file}: {line.key} = {line.value}  →  {option_text(line)}{why}")
    for line in result.ignored:
        value = f" = {line.value}" if line.value else ""
        out.append(f"  ignored  {line.file}: {line.key}{value}  —  {line.why}")
    plain = [line for line in result.defaults if line.why == "no file sets it"]
    for line in result.defaults:
        if line not in plain:
            out.append(f"  default  {option_text(line)}  ({line.why})")
    if plain:
        out.append("  default  " + ", ".join(option_text(line) for line in plain) + "  (no file sets them)")
    return out
