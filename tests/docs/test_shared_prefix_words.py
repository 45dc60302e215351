"""The shared-prefix page and what its commands print use words a new user knows (issue 110 item 10):
no "seams", "logical rows", "remainder", "route" or "door"; "plan" only as the page defines it
(a **sharing plan**, `plan_shared_prefix`); the benchmark's columns named as the page names them
(activations kept: `activations_MiB`)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from doc_blocks import REPO  # noqa: E402

pytestmark = pytest.mark.reader_facing  # the main and newest lanes
UNKNOWN = re.compile(r"\b(seams?|logical rows?|remainders?|routes?|doors?)\b", re.I)
PAGE = (REPO / "docs" / "shared-prefix.md").read_text(encoding="utf-8")
PROSE = " ".join(re.sub(r"(?ms)^```.*?^```", "", PAGE).split())  # the words, without the code blocks


def test_the_page_uses_no_word_a_new_user_does_not_know():
    assert UNKNOWN.findall(PAGE) == []
    assert "**sharing plan**" in PAGE
    bare_plan = [PROSE[max(0, m.start() - 30):m.end() + 10] for m in re.finditer(r"(?<![\w`])plan\b", PROSE)
                 if not PROSE[:m.end()].endswith("sharing plan")]
    assert bare_plan == [], bare_plan


def test_the_benchmarks_columns_are_the_pages_words():
    from megatron_rl_patches.apps.bench import shared_prefix, shared_prefix_attention

    for columns in (shared_prefix.COLUMNS, shared_prefix_attention.COLUMNS):
        assert not [c for c in columns if UNKNOWN.search(c.replace("_", " ")) or c.startswith("saved")], columns
    assert "activations_MiB" in shared_prefix.COLUMNS and "activations kept" in PAGE + (
        REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
