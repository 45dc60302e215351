"""Python blocks of the docs that use names they do not define (a model, a batch, the training
loop's own variables: the docs test supplies them, doc_namespaces.py) say so where a reader sees
it: their first line is `# fragment: uses NAME, ...` listing exactly those names. Every other
python block runs as pasted alone into a fresh interpreter: it defines or imports every name it reads
(not one an earlier block of its page defined: the docs test runs each block alone, doc_fresh.py)."""
from __future__ import annotations

import ast
import builtins

import pytest
from doc_blocks import all_blocks, fragment_names


def _bound_and_used(text: str) -> tuple[set[str], list[str]]:
    """Names the block binds anywhere (assignments, imports, defs, arguments), and the names it
    reads, in order of first use."""
    tree = ast.parse(text)
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    used = [node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)]
    return bound, list(dict.fromkeys(used))


def _fragments() -> list[tuple[str, list[str], list[str]]]:
    """(where, names it reads without binding, names its marker lists) per python block."""
    rows = []
    for block in all_blocks():
        if block.kind != "python":
            continue
        bound, used = _bound_and_used(block.text)
        outside = [n for n in used if n not in bound and not hasattr(builtins, n)]
        rows.append((block.where, outside, fragment_names(block.text)))
    return rows


@pytest.mark.parametrize(("where", "outside", "listed"), _fragments(), ids=[row[0] for row in _fragments()])
def test_a_block_runs_alone_or_says_what_it_uses(where, outside, listed):
    """The marker lists every name from outside the block (each block runs alone), and nothing the
    block does not read."""
    assert set(outside) <= set(listed), (
        f"{where}: the block uses {outside} without defining them; its first line must be "
        f"`# fragment: uses {', '.join(outside)}`")
    assert set(listed) <= set(outside), f"{where}: its `# fragment:` line lists {listed}, it reads {outside}"


def test_the_check_finds_a_name_a_block_does_not_define():
    """Negative control for the name analysis."""
    bound, used = _bound_and_used("import torch\nx = torch.ones(2)\nprint(model(x), [y for y in x])\n")
    assert [n for n in used if n not in bound and not hasattr(builtins, n)] == ["model"]
