"""Sizes a reader can hold: modules of at most 450 lines, functions of at most 60, except the functions
docs/development.md names as kept whole (each with its reason), so an exception is written down where people read."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("tasks", "flows", "serving")
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 450, 60


def kept_whole() -> set[str]:
    text = (REPO / "docs" / "development.md").read_text()
    section = text.split("<!-- kept whole -->", 1)[1].split("<!-- /kept whole -->", 1)[0]
    return set(re.findall(r"^- `([^`]+)`:", section, flags=re.MULTILINE))


def modules() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (REPO / package).rglob("*.py"))


def test_every_module_has_at_most_450_lines():
    long = {
        str(path.relative_to(REPO)): lines
        for path in modules()
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"split these modules: {long}"


def test_functions_over_60_lines_are_the_ones_the_docs_keep_whole():
    long = set()
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            function = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            if function and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                long.add(f"{path.relative_to(REPO)}:{node.name}")
    listed = kept_whole()
    assert long <= listed, (
        f"split these functions or say in docs/development.md why not: {sorted(long - listed)}"
    )
    assert not listed - long, (
        f"docs/development.md keeps whole what is no longer long: {sorted(listed - long)}"
    )
