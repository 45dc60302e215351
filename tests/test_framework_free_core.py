"""The framework-free rooms name no framework in their code (issue 64 item 3; `model/` since issue 113,
`shared_prefix/` since issue 122): `cross_tokenizer/`, `inference/`, `model/` and `shared_prefix/` take
plain inputs and raise errors naming their arguments; building a framework's batch, naming its settings
or its own layers (a framework's model kind: `integrations/slime/model_kinds.py`) is its integration's
(`integrations/<framework>/`). Docstrings and comments may name the framework a function serves;
the code (names, strings, keys, module paths, file names) may not."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import megatron_rl_patches

ROOT = Path(megatron_rl_patches.__file__).resolve().parent
CORE = ("cross_tokenizer", "inference", "model", "shared_prefix")
# a framework's name as a word (not inside another: "overlap" holds "verl"), slime's rollout keys
# (`num_microbatches` is megatron-core's own keyword too: not listed), the slime integration's variables
FRAMEWORK = re.compile(r"(?i)(?<![a-z])(slime|verl|nemo)(?![a-z])|micro_batch_indices|loss_masks"
                       r"|MEGATRON_RL_PATCHES_OPD_")


def _without_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                node.body[0] = ast.Pass()
    return tree


def framework_names(source: str) -> list[str]:
    """The framework names in `source`'s code, its docstrings and comments left out (unparsed by `ast`)."""
    code = ast.unparse(_without_docstrings(ast.parse(source)))
    return [match.group(0) for match in FRAMEWORK.finditer(code)]


def test_no_framework_name_in_the_code_of_the_framework_free_rooms():
    found = {str(path.relative_to(ROOT)): names for room in CORE for path in sorted((ROOT / room).rglob("*.py"))
             if (names := framework_names(path.read_text(encoding="utf-8")))}
    assert found == {}
    named_files = [str(path.relative_to(ROOT)) for room in CORE for path in sorted((ROOT / room).rglob("*"))
                   if FRAMEWORK.search(path.relative_to(ROOT / room).as_posix())]
    assert named_files == []


@pytest.mark.parametrize("source,expected", [
    ('"""Serves slime\'s OPD."""\n# slime reads it\nx = 1\n', []),
    ('def f():\n    """For verl."""\n    return {"micro_batch_indices": []}\n', ["micro_batch_indices"]),
    ('raise ValueError("set slime\'s --hf-checkpoint")\n', ["slime"]),
    ('NAME = "MEGATRON_RL_PATCHES_OPD_TEACHERS"\n', ["MEGATRON_RL_PATCHES_OPD_"]),
    ('overlap_grad_reduce = True\nnum_microbatches = 2\n', []),
    ('from verl.workers import x\n', ["verl"]),
])
def test_the_check_reads_code_not_docstrings(source, expected):
    assert framework_names(source) == expected
