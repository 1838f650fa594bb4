"""Import of real training configs (`--from FILE`, the app's upload box): DeepSpeed JSON, accelerate YAML, Hugging
Face TrainingArguments / TRL SFTConfig, PEFT adapter_config.json, axolotl, LLaMA-Factory and torchtune YAML.

Pure and torch-free: JSON and PyYAML's safe loader only, bounded size, never a pickle, never a path or a name from
a file opened, downloaded or imported. `import_bytes(data, filename)` gives an `ImportResult`: `options` (plan fields
and `model` → values), `used`, `ignored` and `defaults` lines, and `lines()` for the text report.
"""

from llmem.importers.core import ImportResult, Line
from llmem.importers.merge import import_bytes, import_files, import_uploads

__all__ = ["ImportResult", "Line", "import_bytes", "import_files", "import_uploads"]
