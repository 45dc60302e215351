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


SHARED_PREFIX_SECTIONS = ("## Shared-prefix packing (`bench shared-prefix`)",)
OTHER_NAMES = re.compile(r"\b(tries?|tree plans?|one-level plans?)\b", re.I)


def benchmark_sections() -> str:
    text = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    return "\n".join(text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0] for heading in SHARED_PREFIX_SECTIONS)


def test_one_name_for_the_sharing_plan_in_the_docs_the_rows_and_the_plots():
    """Issue 119 item 7: "tree plan", "trie" and "shared prefix" named one thing. The packing is
    "shared prefix" (its sharing plan at every level), `levels=1` "shared prefix, one level": the
    bench's rows and plot legends (the packing column), the pages' prose and tables."""
    from megatron_rl_patches.apps.bench import shared_prefix
    from megatron_rl_patches.apps.bench.shared_prefix_peer import PEER, PEER_UNSHARED

    labels = (shared_prefix.UNSHARED, shared_prefix.SHARED, shared_prefix.ONE_LEVEL)
    assert labels == ("unshared", "shared prefix", "shared prefix, one level")
    section = benchmark_sections()
    assert [OTHER_NAMES.findall(text) for text in (PAGE, section, *labels)] == [[]] * (2 + len(labels))
    shown = {line.split("|")[2].strip().split(" (")[0] for line in section.splitlines()
             if re.match(r"\| (P = |4 turns)", line)}
    assert shown == {*labels, PEER, PEER_UNSHARED}, shown
    for name in ("shared_prefix.csv", "shared_prefix_multi_turn.csv", "shared_prefix_models.csv"):
        rows = (REPO / "docs" / "bench" / name).read_text(encoding="utf-8").splitlines()[1:]
        assert {re.split(r",(?=(?:[^\"]*\"[^\"]*\")*[^\"]*$)", row)[1].strip('"') for row in rows} <= {
            *labels, PEER, PEER_UNSHARED}, name  # what the plots' legends read
