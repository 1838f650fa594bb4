"""The documentation's references resolve: every relative link in README.md and docs/ (notes included) points to a
file (and heading) that exists, every `llmem.module.function` / `module.function` / `llmem/file.py: name` names
something the code defines, DESIGN.md stays a short contract and each MODEL.md section names an existing function.

Torch-free and fast: modules of the pure core are imported, the others (runtime, measure, simulate: they import
torch) are read with `ast` for their top-level names.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "llmem"
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "docs" / "notes").glob("*.md")])
TORCH_PACKAGES = ("llmem.runtime", "llmem.measure", "llmem.simulate", "llmem.derive.trace")

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"\bllmem(?:\.[A-Za-z_]\w*)+")
SHORT = re.compile(r"^([a-z_]\w*)\.([A-Za-z_]\w*)$")  # no call: `optimizer.step()` is code, not a name
FILE_NAMES = re.compile(r"\b((?:llmem/)?[\w/]*?\w+\.py): ([A-Za-z_][\w.]*(?:, [A-Za-z_][\w.]*)*)")


def _module_file(name: str) -> Path | None:
    path = PKG.parent / Path(*name.split("."))
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else None


def _all_modules() -> dict[str, str]:
    """Dotted name of every llmem module, by file path relative to the repository."""
    return {str(p.relative_to(ROOT)): ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            for p in PKG.rglob("*.py")}


# short names usable as `module.function`: the components and the top-level modules (not runtime/measure/simulate,
# whose short names, e.g. `model`, are common words of the text)
SHORT_MODULES = {p.stem: f"llmem.components.{p.stem}" for p in (PKG / "components").glob("*.py")} | {
    p.stem: f"llmem.{p.stem}" for p in PKG.glob("*.py") if not p.stem.startswith("_")}


@cache
def _top_level_names(path: Path) -> dict[str, ast.AST]:
    names: dict[str, ast.AST] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    names[target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
    return names


def _static_has(path: Path, attrs: list[str]) -> bool:
    node = _top_level_names(path).get(attrs[0])
    for attr in attrs[1:]:  # Class.method
        if not isinstance(node, ast.ClassDef):
            return node is not None and isinstance(node, (ast.Import, ast.ImportFrom))
        node = next((n for n in node.body if getattr(n, "name", None) == attr), None)
    return node is not None


def _resolve(dotted: str):
    """(found, object or None): the longest module prefix of `dotted`, then its attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module, attrs = ".".join(parts[:cut]), parts[cut:]
        path = _module_file(module)
        if path is None:
            continue
        if module.startswith(TORCH_PACKAGES):
            return (_static_has(path, attrs) if attrs else True), None
        obj = importlib.import_module(module)
        for attr in attrs:
            if not hasattr(obj, attr):
                return False, None
            obj = getattr(obj, attr)
        return True, obj
    return False, None


def _slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(m) for m in re.findall(r"(?m)^#+ (.+)$", path.read_text())}


def _references(text: str) -> set[str]:
    """Dotted code names the text cites: `llmem.a.b` anywhere, `module.function` as a whole code span."""
    refs = {m.rstrip(".") for m in DOTTED.findall(text)}
    for span in CODE.findall(text):
        m = SHORT.match(span.strip())
        if m and m.group(1) in SHORT_MODULES:
            refs.add(f"{SHORT_MODULES[m.group(1)]}.{m.group(2)}")
    return refs


def _file_references(text: str) -> list[tuple[str, list[str], list[str]]]:
    """`llmem/x/y.py: a, b` or `estimate.py: a` (a file of the package), with the names cited after the colon."""
    modules = _all_modules()
    out = []
    for path, names in FILE_NAMES.findall(text):
        if path.startswith("llmem/"):
            candidates = [path]
        else:
            candidates = [p for p in modules if p.endswith("/" + path)]
            if not candidates or "/" in path and not path.startswith("llmem"):
                continue  # another project's file (torch, transformers, bitsandbytes ...)
        out.append((f"{path}: {names}", candidates, names.split(", ")))
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{doc.name}: broken links {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_references_resolve(doc: Path):
    text = doc.read_text()
    missing = sorted(ref for ref in _references(text) if not _resolve(ref)[0])
    for cited, candidates, names in _file_references(text):
        for name in names:
            if not any((ROOT / c).is_file() and _static_has(ROOT / c, name.split(".")) for c in candidates):
                missing.append(f"{cited} -> {name}")
    assert not missing, f"{doc.name}: names that do not exist {missing}"


def test_design_is_a_short_contract():
    design = (ROOT / "docs" / "DESIGN.md").read_text()
    assert len(design.splitlines()) <= 150
    assert not re.search(r"\bwas [−+-]?\d", design), "measurement history belongs in docs/notes"


def test_docs_stay_under_400_lines():
    long = [str(p.relative_to(ROOT)) for p in DOCS if len(p.read_text().splitlines()) > 400]
    assert not long


@pytest.mark.parametrize("name", ["MODEL.md", "MODEL-DERIVED.md"])
def test_each_model_section_names_a_function(name):
    text = (ROOT / "docs" / name).read_text()
    sections = re.split(r"(?m)^## ", text)[1:]
    assert len(sections) >= (10 if name == "MODEL.md" else 2)
    for section in sections:
        title = section.splitlines()[0]
        if title == "Symbols":
            continue
        functions = [ref for ref in _references(section) if inspect.isfunction(_resolve(ref)[1])]
        assert functions, f"{name} section {title!r} names no existing function"


def test_checking_the_references_needs_no_torch():
    modules = sorted({m for doc in DOCS for ref in _references(doc.read_text())
                      for m in [".".join(ref.split(".")[:i]) for i in range(2, len(ref.split(".")) + 1)]
                      if _module_file(m) and not m.startswith(TORCH_PACKAGES)})
    code = f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
