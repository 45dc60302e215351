"""No hidden channel without its reason (issue 107): every ContextVar of the package and every
`global` statement says, in a comment on its line or in the comment right above it, the signature
that cannot carry it as an argument ("not an argument: ..."). Read on the source with `ast` and
its comments; the checker is tested on small synthetic modules too, so a rule that can no longer
fail shows."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import megatron_rl_patches

ROOT = Path(megatron_rl_patches.__file__).resolve().parent
WORDS = "not an argument"


def channels(source: str) -> list[int]:
    """The lines of `source` that make a ContextVar or rebind a name through `global`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Global):
            found.append(node.lineno)
        elif isinstance(node, ast.Call) and callee(node) == "ContextVar":
            found.append(node.lineno)
    return sorted(set(found))


def callee(call: ast.Call) -> str:
    """The name a call calls (`contextvars.ContextVar(...)` and `ContextVar(...)` alike)."""
    return call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")


def unexplained(source: str) -> list[int]:
    """The channels of `source` with no "not an argument" on their line or in the comment block above."""
    lines = source.splitlines()
    missing = []
    for number in channels(source):
        said = WORDS in lines[number - 1].lower()
        above = number - 2
        while not said and above >= 0 and lines[above].lstrip().startswith("#"):
            said = WORDS in lines[above].lower()
            above -= 1
        if not said:
            missing.append(number)
    return missing


def test_every_context_variable_and_global_says_why_no_argument_carries_it():
    found = {path.relative_to(ROOT).as_posix(): lines for path in sorted(ROOT.rglob("*.py"))
             if (lines := unexplained(path.read_text()))}
    assert found == {}, f"a ContextVar or `global` without its reason (# not an argument: SIGNATURE ...): {found}"


def context_variables(source: str) -> int:
    """How many ContextVars `source` makes."""
    return sum(1 for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call) and callee(node) == "ContextVar")


def test_the_package_holds_at_most_six_context_variables():
    """Issue 122 item 3: 8 at 9e804589; slime's rollout tokens now travel in the schedule's own argument
    (integrations/slime/micro_batches.py) and the MoE router's plan with its layer's call
    (shared_prefix/moe_statistics.py). A seventh needs an argument or an owner instead."""
    sources = {path.relative_to(ROOT).as_posix(): path.read_text() for path in sorted(ROOT.rglob("*.py"))}
    found = {name: count for name, source in sources.items()
             if "ContextVar" in source and (count := context_variables(source))}
    assert sum(found.values()) <= 6, found


@pytest.mark.parametrize(("source", "expected"), [
    ("import contextvars\nX = contextvars.ContextVar('x')", [2]),
    ("import contextvars\n# not an argument: f(a, b) is theirs\nX = contextvars.ContextVar('x')", []),
    ("from contextvars import ContextVar\n# the rows\n# Not an argument: g() is fixed\nX = ContextVar('x')", []),
    ("_done = False\ndef run():\n    global _done\n    _done = True", [3]),
    ("_done = False\ndef run():\n    global _done  # not an argument: run() takes none\n    _done = True", []),
    ("# not an argument: far above\n\nX = 1\nimport contextvars\nY = contextvars.ContextVar('y')", [5]),
])
def test_the_checker_finds_an_unexplained_channel_and_nothing_else(source, expected):
    assert unexplained(source) == expected
