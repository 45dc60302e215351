"""docs/shared-prefix.md's framework x layout matrix, written from the table (`table.FEATURES`) so the page
cannot say what the doors do not: tools/doc_shared_prefix_matrix.py writes it between the page's markers,
tests/docs/test_shared_prefix_matrix.py fails where the two differ."""
from __future__ import annotations

import re

from megatron_rl_patches.integrations.shared_prefix_doors.frameworks import FRAMEWORKS, MEGATRON
from megatron_rl_patches.integrations.shared_prefix_doors.table import FEATURES, NOT_RUN, SHARED, Cell

START, END = "<!-- shared-prefix-matrix -->", "<!-- /shared-prefix-matrix -->"
HEADS = {"slime": "slime", "verl": "verl 0.9", "nemo-rl": "NeMo-RL", "megatron": "a hand-written loop"}
# a setting as the user types it: `--flag`, `a.b.c=value`, `name=value`
SETTING = re.compile(r"(\+?[A-Za-z_][\w.]*=[\w.\-\"]+|--[a-z][\w-]*)")


def _code(text: str) -> str:
    return SETTING.sub(lambda found: f"`{found.group(1)}`", text)


def cell_text(framework_key: str, cell: Cell) -> str:
    """One cell: shared (and how), packed whole (why; what to change), refused for a hand-written loop
    (`check_shared_prefix` raises), or n.a. (why)."""
    if cell.outcome == SHARED:
        return "shared" + (f": {_code(cell.why)}" if cell.why else "")
    if cell.outcome == NOT_RUN:
        return f"n.a.: {_code(cell.why)}"
    head = "refused" if framework_key == MEGATRON else "packed whole"
    return f"{head}: {_code(cell.why)}; to share: {_code(cell.change)}"


def matrix_markdown() -> str:
    """The matrix as the page holds it between its markers (a Markdown table, one row per layout or model kind)."""
    lines = ["| layout or model | " + " | ".join(HEADS[key] for key in FRAMEWORKS) + " |",
             "|---" * (len(FRAMEWORKS) + 1) + "|"]
    for row in FEATURES:
        cells = [cell_text(key, row.cells[key]).replace("|", "\\|") for key in FRAMEWORKS]
        lines.append(f"| {row.title} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rewritten(text: str) -> str:
    """`text` with the block between the markers made the table's matrix."""
    if START not in text or END not in text:
        raise ValueError(f"the page has no {START} ... {END} block")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{matrix_markdown()}\n{END}{tail}"
