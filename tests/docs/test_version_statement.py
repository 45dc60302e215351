"""One statement of the supported megatron-core range, derived from the code (the patch records'
SUPPORTED specifier and the TESTED releases), word for word in README, docs/index.md and
docs/compatibility.md; no other range statement in README or the index contradicts it."""
from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from doc_blocks import REPO  # noqa: E402

from megatron_rl_patches.integrations.megatron.version import SUPPORTED, TESTED

PAGES = ("README.md", "docs/index.md", "docs/compatibility.md")
RANGE = re.compile(r"\b0\.13\b(?:\.\d+)?\s+(?:to|through|up to)\s+(?:main's\s+)?0\.(\d+)\b")


def statement() -> str:
    low, high = re.fullmatch(r">=(\d+\.\d+),<(\d+\.\d+)", SUPPORTED).groups()
    major, minor = map(int, high.split("."))
    last = f"{major}.{minor - 1}"
    return f"Supported: megatron-core {low} to {last} (`{SUPPORTED}`); tested releases: {', '.join(TESTED)}."


def text(page: str) -> str:
    return " ".join((REPO / page).read_text(encoding="utf-8").split())


def test_the_range_statement_is_derived_from_the_code_and_the_same_everywhere():
    want = statement()
    assert "0.13 to 0.20" in want and "0.19.2" in want  # the derivation itself
    assert {page: want in text(page) for page in PAGES} == dict.fromkeys(PAGES, True), want


def test_no_other_range_statement_in_readme_or_the_index_disagrees():
    last = statement().split(" to ", 1)[1].split()[0]
    for page in ("README.md", "docs/index.md"):
        upper = {f"0.{m}" for m in RANGE.findall(text(page))}
        assert upper <= {last}, (page, upper)
