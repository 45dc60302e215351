"""Settings are read once, at a door, from one module (issue 107): no module of the package reads the
environment (`os.environ`, `os.getenv`, `os.environb`) but `settings.py`, the start-up machinery
(`patching/`) and the apps (the test kit's child processes take theirs from `settings` too:
`child_environment`, `process_environment`). Read on the source with `ast`; the checker is tested on
small synthetic modules too, so a rule that can no longer fail shows."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import megatron_rl_patches

ROOT = Path(megatron_rl_patches.__file__).resolve().parent
READERS = ("settings.py",)  # the settings module: every variable's reader
DOORS_OF_THEIR_OWN = ("patching/", "apps/")  # the start-up machinery, the command line


def environment_reads(tree: ast.AST) -> list[int]:
    """The lines of `tree` that touch the process's environment: `os.environ` / `os.environb` /
    `os.getenv` (or the names imported from os)."""
    names = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
             and node.module == "os" for alias in node.names if alias.name in ("environ", "environb", "getenv")}
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "environb", "getenv") \
                and isinstance(node.value, ast.Name) and node.value.id == "os":
            lines.append(node.lineno)
        elif isinstance(node, ast.Name) and node.id in names:
            lines.append(node.lineno)
    return sorted(set(lines))


def test_only_the_settings_module_reads_the_environment():
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        where = path.relative_to(ROOT).as_posix()
        if where in READERS or where.startswith(DOORS_OF_THEIR_OWN):
            continue
        lines = environment_reads(ast.parse(path.read_text(), str(path)))
        if lines:
            found[where] = lines
    assert found == {}, ("the environment is read outside megatron_rl_patches/settings.py: add a reader there and "
                         f"call it once at the door (docs/design.md, 'Where to add … a setting'): {found}")


@pytest.mark.parametrize(("source", "expected"), [
    ("import os\nx = os.environ.get('A')", [2]),
    ("import os\nx = os.getenv('A')", [2]),
    ("from os import environ\nx = environ['A']", [2]),
    ("import os\nx = os.path.join('a', 'b')", []),
    ("def f(environ):\n    return environ.get('A')", []),  # a mapping handed in: no read of the process's
])
def test_the_checker_finds_a_read_and_nothing_else(source, expected):
    assert environment_reads(ast.parse(source)) == expected
