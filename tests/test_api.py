"""The package's public functions: never shadowed by their submodules, and the core imports no torch."""

import subprocess
import sys


def test_public_functions_survive_importing_every_submodule():
    code = ("import importlib, pkgutil, sys, types, llmem\n"
            "for m in pkgutil.walk_packages(llmem.__path__, 'llmem.'):\n"
            "    if not m.name.endswith('__main__'):\n"
            "        importlib.import_module(m.name)\n"
            "for name in llmem.__all__:\n"
            "    assert not isinstance(getattr(llmem, name), types.ModuleType), name\n"
            "from llmem import compare, estimate, plan_checkpointing\n"
            "assert all(isinstance(f, types.FunctionType) for f in (compare, estimate, plan_checkpointing))\n"
            "assert sys.modules['llmem.estimate'].estimate.__module__ == 'llmem.estimate'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_module_imports_first():
    """Any module may be the first of the package a script imports: no import cycle depends on the order (each
    module imported into a fresh copy of the package, torch and transformers kept loaded)."""
    code = ("import importlib, pkgutil, sys, llmem\n"
            "names = [m.name for m in pkgutil.walk_packages(llmem.__path__, 'llmem.') if '__main__' not in m.name]\n"
            "for name in names:\n"
            "    for loaded in [m for m in sys.modules if m == 'llmem' or m.startswith('llmem.')]:\n"
            "        del sys.modules[loaded]\n"
            "    importlib.import_module(name)\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_compare_passes_variants_through():
    from llmem import compare
    from llmem.compare import method_variants
    from llmem.plan import TrainingPlan
    from llmem.presets import load_preset
    from llmem.spec import ModelSpec

    spec = ModelSpec.from_config(load_preset("llama-3.2-1b-instruct"))
    plain = compare(spec, TrainingPlan(gpus=2), 80 * 2**30)
    with_lora = compare(spec, TrainingPlan(gpus=2), 80 * 2**30, variants=method_variants("lora"))
    assert len(with_lora.to_frame()) > len(plain.to_frame())


def test_the_core_imports_no_heavy_library():
    """The library's core (estimate, compare, plan-ckpt, links, CLI parsing) runs without torch, transformers,
    streamlit, pandas or plotly: a strategy table must not pay their import time."""
    code = ("import sys, llmem, llmem.estimate, llmem.compare, llmem.checkpointing, llmem.share, llmem.notes, "
            "llmem.cli, llmem.help\n"
            "from llmem.presets import load_preset\nfrom llmem.spec import ModelSpec\n"
            "from llmem.plan import TrainingPlan\n"
            "spec = ModelSpec.from_config(load_preset('llama-3.1-8b'))\n"
            "llmem.estimate(spec, TrainingPlan(gpus=8, zero=3))\n"
            "llmem.compare(spec, TrainingPlan(gpus=8), 80 * 2**30)\n"
            "llmem.plan_checkpointing(spec, TrainingPlan(), 80 * 2**30)\n"
            "heavy = [m for m in ('torch', 'transformers', 'streamlit', 'pandas', 'plotly') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_no_file_over_400_lines_and_no_function_over_60_in_the_package():
    """The layout the style asks for: a concept a file (≤ 400 lines), a moment or term a function (≤ 60 lines)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    files = sorted((root / "llmem").rglob("*.py")) + [root / "app.py"]
    long_files = [str(p.relative_to(root)) for p in files if len(p.read_text().splitlines()) > 400]
    long_functions = [f"{p.relative_to(root)}:{n.name} ({n.end_lineno - n.lineno + 1})" for p in files
                      for n in ast.walk(ast.parse(p.read_text()))
                      if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.end_lineno - n.lineno >= 60]
    assert not long_files and not long_functions, (long_files, long_functions)
