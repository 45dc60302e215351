"""CHANGELOG.md's headings say what users look for: a version (`## [0.1.0]`) or, under
`[Unreleased]`, the date of each group of changes — never the project's internal "round N"."""
from __future__ import annotations

import re

from doc_blocks import REPO


def test_every_heading_carries_a_version_or_a_date():
    headings = [line for line in (REPO / "CHANGELOG.md").read_text(encoding="utf-8").splitlines()
                if line.startswith("##")]
    assert not [h for h in headings if re.search(r"\bround\b", h, re.IGNORECASE)], headings
    section = ""
    for heading in headings:
        if heading.startswith("## "):
            section = heading
            assert re.fullmatch(r"## \[(Unreleased|\d+\.\d+\.\d+)\].*", heading), heading
        elif section == "## [Unreleased]":
            assert re.search(r"\(\d{4}-\d{2}-\d{2}\b", heading), heading
