"""The import graph, checked where ``make lint``'s contracts cannot say it.

import-linter (``[tool.importlinter]`` in pyproject.toml) keeps the layers; these tests add what a
layer list does not: no two apps import each other by any chain, and no import hides in a function
body unless a comment says why it must (a deferral is how an import cycle hides from the graph).
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("agents", "core", "controlplane", "jobs", "nodes", "checkpoints", "alerts", "dashboard")


def test_no_two_packages_import_each_other():
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    cycles = []
    for a, b in itertools.combinations(PACKAGES, 2):
        down = graph.find_shortest_chain(importer=a, imported=b, as_packages=True)
        up = graph.find_shortest_chain(importer=b, imported=a, as_packages=True)
        if down and up:
            cycles.append(f"{a} <-> {b}: {' -> '.join(down)} and {' -> '.join(up)}")
    assert not cycles, "import cycles between packages:\n" + "\n".join(cycles)


def deferred_imports(path: Path) -> list[tuple[int, bool]]:
    """``(line, explained)`` for each import inside a function body of ``path``.

    Explained: the import line carries a comment (a bare ``noqa`` explains nothing), or the first
    line above it that is neither blank nor another deferred import is a comment: one comment may
    explain a block of imports.
    """
    source = path.read_text()
    lines = source.splitlines()
    imports = [node for function in ast.walk(ast.parse(source))
               if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
               for node in ast.walk(function) if isinstance(node, (ast.Import, ast.ImportFrom))]
    covered = {line for node in imports for line in range(node.lineno, (node.end_lineno or node.lineno) + 1)}
    found = set()
    for node in imports:
        trailing = lines[node.lineno - 1].partition("#")[2].strip()
        above = node.lineno - 1
        while above > 0 and (above in covered or not lines[above - 1].strip()):
            above -= 1
        explained = (bool(trailing) and not trailing.startswith("noqa")) or (
            above > 0 and lines[above - 1].strip().startswith("#"))
        found.add((node.lineno, explained))
    return sorted(found)


def test_every_deferred_import_says_why():
    unexplained = [
        f"{path.relative_to(ROOT)}:{line}"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if "migrations" not in path.parts
        for line, explained in deferred_imports(path)
        if not explained
    ]
    assert not unexplained, ("imports inside functions without a comment saying why they cannot sit at the "
                             "top of the module:\n" + "\n".join(unexplained))


def test_the_deferral_check_reads_comments_as_meant(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "def a():\n"
        "    import os\n"
        "def b():\n"
        "    # heavy: only when asked\n"
        "    import json\n"
        "def c():\n"
        "    import re  # noqa: PLC0415\n"
        "def d():\n"
        "    import csv  # an optional dependency\n"
        "def e():\n"
        "    x = 1\n"
        "    # the app registry must be ready\n"
        "    from a import (b,\n"
        "                   c)\n"
        "\n"
        "    from d import e\n"
        "    y = 2\n"
        "    import f\n"
    )
    assert deferred_imports(sample) == [(2, False), (5, True), (7, False), (9, True), (13, True), (16, True),
                                        (18, False)]
