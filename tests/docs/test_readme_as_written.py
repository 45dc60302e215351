"""README's fragments run as written: every name a python block reads is defined in README itself
(imported or assigned in that block or one above it), never slipped in by the docs test's namespace;
what the reader must bring instead is said in the prose beside it."""
from __future__ import annotations

import ast
import builtins
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from doc_blocks import REPO, page_blocks  # noqa: E402
from doc_namespaces import PAGES  # noqa: E402


def _names(tree: ast.AST) -> tuple[set[str], set[str]]:
    """(names read, names bound) anywhere in `tree`."""
    read, bound = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return read, bound


def test_every_name_a_readme_fragment_reads_is_defined_in_readme():
    blocks = [b for b in page_blocks(REPO / "README.md") if b.kind == "python"]
    assert len(blocks) >= 3
    defined, undefined = set(dir(builtins)), {}
    for block in blocks:
        read, bound = _names(ast.parse(block.text))
        defined |= bound
        missing = sorted(read - defined)
        if missing:
            undefined[block.where] = missing
    assert undefined == {}, f"README fragments read names they never define: {undefined}"


def test_the_docs_test_gives_readme_nothing():
    from contextlib import ExitStack

    with ExitStack() as stack:
        namespace = PAGES["README.md"].build(stack)
    assert namespace == {} and PAGES["README.md"].replace(namespace) == {}
