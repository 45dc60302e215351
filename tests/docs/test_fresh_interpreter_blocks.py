"""Docs blocks a newcomer pastes into a fresh interpreter run there as pasted (issue 63 item 9: the
Hugging Face teacher snippet needed `apply(only=["gpt_output_processor"])`, testing.md's
`write_tiny_checkpoint` block Megatron's parallel state, which the page harness's world gave it): each
block marked "runs as pasted in a fresh interpreter" runs in `python -c`, no harness around it (every
other python block of the docs does too, doc_fresh.py: these need megatron-core >= 0.16)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from doc_blocks import REPO, all_blocks  # noqa: E402
from doc_fresh import fresh_environ  # noqa: E402

MARK = "runs as pasted in a fresh interpreter"
FRESH = [block for block in all_blocks() if block.kind == "skip" and MARK in block.detail]


def test_the_blocks_the_issue_names_are_held_to_it():
    assert {block.where.split(":")[0] for block in FRESH} >= {"docs/inference-only.md", "docs/testing.md"}


@pytest.mark.megatron
@pytest.mark.reader_facing  # the main and newest lanes
@pytest.mark.parametrize("block", FRESH, ids=[block.where for block in FRESH])
def test_the_block_runs_as_pasted_in_a_fresh_interpreter(block):
    from megatron.core.package_info import __version__

    if tuple(int(part) for part in __version__.split(".")[:2]) < (0, 16):
        pytest.skip(f"the Qwen3.5 family needs megatron-core >= 0.16, not {__version__}")
    proc = subprocess.run([sys.executable, "-c", "\n" * block.line + block.text], cwd=REPO, env=fresh_environ(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
