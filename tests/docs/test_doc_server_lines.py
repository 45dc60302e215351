"""Every block of the docs that starts a vLLM server (outside a GPU trainer's command) holds a line
that runs as pasted on vLLM's CPU build: the module started with the CPU backend's settings in
front (without them it stops at start-up: "Available memory ... less than desired CPU memory
utilization"), a pooling line for a pooling block. The served lane starts each of those lines as
written (tests/teachers/lane/test_served_doc_commands.py)."""
from __future__ import annotations

import pytest
from doc_servers import CPU_PREFIX, cpu_lines, server_blocks

BLOCKS = server_blocks()


def test_the_docs_have_server_blocks():
    assert len(BLOCKS) >= 4, [b.where for b in BLOCKS]


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_each_server_block_has_a_cpu_line_that_starts_as_pasted(block):
    lines = cpu_lines(block)
    assert lines, f"{block.where}: a vLLM server block without a CPU line (vLLM's CPU build: {CPU_PREFIX}python -m ...)"
    for line in lines:
        assert line.startswith(CPU_PREFIX), f"{block.where}: {line!r} does not start with {CPU_PREFIX!r}"
    if "--runner pooling" in block.text:
        assert any("--runner pooling" in line for line in lines), \
            f"{block.where}: a pooling block without a CPU pooling line"
