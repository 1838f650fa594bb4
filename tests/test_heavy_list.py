"""tests/heavy_list.txt names tests that exist: a renamed test or parameter would otherwise fall back into the
default run (or, for a listed file, out of it) without anyone noticing."""

import ast
import re
from pathlib import Path

from conftest import heavy_ids

ROOT = Path(__file__).parents[1]


def _functions(path: Path) -> set[str]:
    return {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}


def test_each_listed_test_is_a_test_function_of_its_file():
    for node_id in heavy_ids():
        path, _, rest = node_id.partition("::")
        name = re.sub(r"\[.*\]$", "", rest)
        assert (ROOT / path).is_file(), node_id
        assert name.startswith("test_") and name in _functions(ROOT / path), node_id


def test_the_list_marks_its_tests_heavy(pytestconfig):
    """The hook ran on this session's items: a listed test collected here carries the mark."""
    import pytest

    items = [i for i in pytestconfig.pluginmanager.get_plugin("session").items] if hasattr(
        pytestconfig.pluginmanager.get_plugin("session"), "items") else []
    listed = [i for i in items if i.nodeid in heavy_ids()]
    for item in listed:
        assert item.get_closest_marker("heavy") is not None, item.nodeid
    if not items:
        pytest.skip("no session items to inspect")
