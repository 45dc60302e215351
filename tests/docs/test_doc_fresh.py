"""Negative controls of the fresh-interpreter docs runner (doc_fresh.py): a block that reads a name an
earlier block defined, or one the harness used to give every block, fails alone, named by page and
line; a block that defines what it reads prints what it prints."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from doc_blocks import Block  # noqa: E402
from doc_fresh import start_block  # noqa: E402


def test_a_block_using_an_earlier_blocks_name_fails_alone_naming_its_page_and_line():
    earlier = start_block(Block("docs/x.md", 10, "python", "import math\nvalue = math.pi\n", "python"))
    later = start_block(Block("docs/x.md", 20, "python", "print('start')\nprint(value)\n", "python"))
    assert earlier.finish() == {"docs/x.md:10": ""}
    with pytest.raises(AssertionError, match=r"(?s)docs/x\.md:20: fails in a fresh interpreter.*"
                                             r"line 22.*NameError: name 'value' is not defined"):
        later.finish()


def test_what_a_block_prints_comes_back_by_page_and_line():
    text = "print(sorted(k for k in globals() if not k.startswith('__')))\nimport sys\nprint('torch' in sys.modules)\n"
    run = start_block(Block("docs/x.md", 3, "python", text, "python"))
    assert run.finish() == {"docs/x.md:3": "[]\nFalse\n"}  # nothing defined, nothing imported
