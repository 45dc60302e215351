"""Docs python blocks run as a reader runs them (issue 63 item 9): each block that defines what it
uses is pasted alone into a fresh interpreter (`python -c`, its text preceded by blank lines so a
traceback's line is the markdown line); a page's `# fragment: uses ...` blocks run in one fresh
interpreter of their own, given exactly the names they list (doc_fragment_run.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from doc_blocks import REPO, Block, fragment_names

TIMEOUT = 600
# the pages a new user pastes from first: their blocks print no warnings (megatron-core's notes that
# Transformer Engine / Apex are missing are filtered in the block, as the README does)
QUIET_PAGES = ("README.md:", "docs/privileged-teachers.md:")
FRAGMENT_RUNNER = Path(__file__).with_name("doc_fragment_run.py")


def fresh_environ() -> dict[str, str]:
    """The test's environment without the package's own variables (a reader's shell sets none)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_RL_PATCH")}


@dataclass
class Run:
    """One fresh interpreter: a block pasted alone, or a page's fragments."""
    what: str
    proc: subprocess.Popen
    printed_file: Path | None = None

    def finish(self) -> dict[str, str]:
        """{block.where: what it printed}; a failure names the page and line of the block."""
        try:
            stdout, stderr = self.proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"{self.what}: still running after {TIMEOUT} s in a fresh interpreter") from None
        assert self.proc.returncode == 0, (
            f"{self.what}: fails in a fresh interpreter (exit {self.proc.returncode}):\n{stderr[-4000:]}")
        if self.printed_file is None:
            assert not (self.what.startswith(QUIET_PAGES) and "Warning" in stderr), (  # these pages' blocks
                f"{self.what}: warns in a fresh interpreter:\n{stderr[-2000:]}")  # hide megatron's notes
            return {self.what: stdout}
        return json.loads(self.printed_file.read_text())


def start_block(block: Block) -> Run:
    """`python -c BLOCK` in a temporary folder, as pasted: nothing defined, nothing imported."""
    proc = subprocess.Popen([sys.executable, "-c", "\n" * block.line + block.text], cwd=tempfile.gettempdir(),
                            env=fresh_environ(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return Run(block.where, proc)


def start_fragments(page: str, folder: Path) -> Run:
    """The page's fragments, in order, in one fresh interpreter that builds what they use."""
    printed = folder / "printed.json"
    proc = subprocess.Popen([sys.executable, str(FRAGMENT_RUNNER), page, str(printed)], cwd=REPO,
                            env=fresh_environ(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return Run(f"{page}'s fragments", proc, printed)


def run_page_python(blocks: list[Block], folder: Path) -> Iterator[tuple[str, str]]:
    """(where, printed) for every python block of one page, all its interpreters started at once."""
    runs = [start_block(b) for b in blocks if not fragment_names(b.text)]
    if any(fragment_names(b.text) for b in blocks):
        runs.append(start_fragments(blocks[0].page, folder))
    try:
        for run in runs:
            yield from run.finish().items()
    finally:
        for run in runs:
            if run.proc.poll() is None:
                run.proc.kill()
                run.proc.wait()
