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


def test_the_hook_marks_listed_tests_heavy_and_no_other():
    import conftest

    class Item:
        def __init__(self, nodeid):
            self.nodeid, self.marks = nodeid, []

        def add_marker(self, mark):
            self.marks.append(mark.name)

    listed, other = Item(sorted(heavy_ids())[0]), Item("tests/test_heavy_list.py::test_not_listed")
    conftest.pytest_collection_modifyitems(None, [listed, other])
    assert listed.marks == ["heavy"] and other.marks == []
