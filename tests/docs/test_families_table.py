"""docs/inference-only.md's family x feature table, kept true: one row per registered family, per
family refused by name and per RoPE type (supported or refused), the status the code gives it, a
refused family's reason as the error says it, and a test that exists for each row. "supported", not
"served" (issue 72 item 10g): a served teacher is one behind an inference engine."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from megatron_rl_patches.inference.loading.hf.families import REFUSED, REGISTRY
from megatron_rl_patches.inference.loading.hf.rope_scaling import SERVED

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "inference-only.md"
MARK = "<!-- families-table"
ROW = re.compile(r"^\| (RoPE )?`([\w.-]+)` \| (supported|refused) \| (.+) \| `([^`]+)` \|$")
REFUSED_ROPE = ("dynamic", "longrope")


def _rows() -> dict[str, tuple[str, str, str]]:
    lines = PAGE.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(MARK))
    rows = {}
    for line in lines[start + 3:]:
        if not line.startswith("|"):
            break
        match = ROW.match(line)
        assert match, f"row not in the table's form: {line}"
        rope, name, status, what, test = match.groups()
        rows[("rope " if rope else "") + name] = (status, what, test)
    return rows


def test_every_family_and_rope_type_has_its_row_and_status():
    rows = _rows()
    want = {**{name: "supported" for name in REGISTRY}, **{name: "refused" for name in REFUSED},
            **{f"rope {kind}": "supported" for kind in SERVED}, **{f"rope {kind}": "refused" for kind in REFUSED_ROPE}}
    assert {name: status for name, (status, _, _) in rows.items()} == want
    for name, reason in REFUSED.items():
        assert rows[name][1] == reason  # the error's words


def test_every_row_names_a_test_that_exists():
    for name, (_, _, node) in _rows().items():
        file, function = node.split("::")
        tree = ast.parse((REPO / file).read_text(encoding="utf-8"))
        assert function in {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}, (name, node)
