"""The docs test's own machinery: block classification, output matching, CLI parsing, signatures."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from doc_blocks import Block, classify, page_blocks  # noqa: E402
from doc_running import cli_commands, listed_signatures, output_matches, signature_mismatches  # noqa: E402


def test_output_matching_normalizes_whitespace_and_expands_ellipsis_lines():
    assert output_matches("a  b\n\nc\n", "a b\n\nc   \n\n")
    assert output_matches("head\n...\ntail\n", "head\nx\ny\ntail\n")
    assert output_matches("head\n...\ntail\n", "head\ntail\n")
    assert not output_matches("head\n...\ntail\n", "head\nx\n")
    assert not output_matches("a\nb\n", "a\nb\nc\n")  # no silent extra lines
    assert not output_matches("a b\n", "ab\n")


def test_classification():
    assert classify("python", "x = 1\n", None) == ("python", "")
    assert classify("bash", "make demo\n", None)[0] == "unmarked"
    assert classify("", "$ megatron-rl-patches memory --params 1\nout\n", None) == ("cli", "")
    assert classify("", "$ megatron-rl-patches list\n", None)[0] == "unmarked"  # no output shown
    assert classify("bash", "$ pip install x\nok\n", None)[0] == "unmarked"
    assert classify("bash", "x\n", "skip: needs a GPU") == ("skip", "needs a GPU")
    assert classify("", "x\n", "output-of: report") == ("output", "report")
    assert classify("", "x\n", "output") == ("output", "")
    assert classify("", "x\n", "skipp: typo")[0] == "unmarked"


def test_page_blocks_read_indented_fences_and_markers(tmp_path, monkeypatch):
    import doc_blocks

    monkeypatch.setattr(doc_blocks, "REPO", tmp_path)
    page = tmp_path / "p.md"
    page.write_text("text\n\n1. item\n\n   <!-- docs-test: skip: why -->\n   ```python\n   x = 1\n   ```\n")
    (block,) = page_blocks(page)
    assert (block.line, block.kind, block.detail, block.text) == (6, "skip", "why", "x = 1\n")


def test_cli_commands_join_continuations_and_pair_outputs():
    text = "$ A=1 megatron-rl-patches memory \\\n    --params 5\nline 1\nline 2\n$ megatron-rl-patches list\nx\n"
    pairs = list(cli_commands(Block("p.md", 1, "", text, "cli")))
    assert pairs == [("A=1 megatron-rl-patches memory --params 5", "line 1\nline 2\n"),
                     ("megatron-rl-patches list", "x\n")]


def test_signature_listing_finds_wrong_names_kinds_and_defaults():
    def real(a, b, *, c=None, d=1.0):
        return a

    listed = listed_signatures("real(a, b, *, c=None, d=1.0)\n    -> thing [T]\nother(x) -> y\n")
    assert set(listed) == {"real", "other"}
    assert signature_mismatches("real", listed["real"], real) == []
    for wrong in ("real(a, b, c=None, *, d=1.0)", "real(a, b, *, c=None, d=2.0)", "real(a, *, c=None, d=1.0)",
                  "real(a, b=0, *, c=None, d=1.0)"):
        assert signature_mismatches("real", listed_signatures(wrong)["real"], real), wrong
