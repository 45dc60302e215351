"""README's fragments run as written: every name a python block reads is defined in README itself
(imported or assigned in that block or one above it), never slipped in by the docs test's namespace;
what the reader must bring instead is said in the prose beside it."""
from __future__ import annotations

import ast
import builtins
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

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


@pytest.mark.megatron
def test_each_readme_fragment_runs_alone_verbatim_in_a_fresh_process():
    """What a reader does: paste one block into a new interpreter (no earlier block's `apply()`,
    no substituted path). A block followed by an output block without `...` prints exactly it."""
    blocks = page_blocks(REPO / "README.md")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_RL_PATCHES")}
    failed = {}
    for i, block in enumerate(blocks):
        if block.kind != "python":
            continue
        proc = subprocess.run([sys.executable, "-c", block.text], capture_output=True, text=True, env=env,
                              timeout=300, cwd=tempfile.gettempdir())
        shown = blocks[i + 1] if i + 1 < len(blocks) and blocks[i + 1].kind == "output" else None
        if proc.returncode != 0:
            failed[block.where] = proc.stderr.strip().splitlines()[-1:]
        elif "Warning" in proc.stderr:  # issue 49: megatron-core's Transformer Engine / Apex notes flooded them
            failed[block.where] = [line for line in proc.stderr.splitlines() if "Warning" in line][:3]
        elif shown is not None and "..." not in shown.text and proc.stdout.strip() != shown.text.strip():
            failed[block.where] = [f"printed {proc.stdout.strip()!r}, README shows {shown.text.strip()!r}"]
    assert failed == {}
