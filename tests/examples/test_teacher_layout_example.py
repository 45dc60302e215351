"""The 2-rank teacher-layout example (examples/teacher_layout_2rank.py), run as its docstring says
(`python examples/teacher_layout_2rank.py`, a fresh interpreter): each rank scores its own rows with the
TP=2 teacher to the whole teacher's log-probs, holding half the embedding rows (issue 63 item 9: the
teacher-layout Python API had only a fragment)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.megatron, pytest.mark.reader_facing, pytest.mark.multirank]  # main and newest lanes
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "teacher_layout_2rank.py"


def test_the_example_runs_as_written_and_each_rank_matches_the_whole_teacher():
    from megatron.core.package_info import __version__

    if tuple(int(part) for part in __version__.split(".")[:2]) < (0, 15):  # ProcessGroupCollection
        pytest.skip(f"a teacher at its own layout needs megatron-core >= 0.15, not {__version__}")
    proc = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("rank ")]
    assert len(lines) == 2, proc.stdout
    for rank, line in enumerate(lines):
        assert line.startswith(f"rank {rank}: rows ({2 + rank}, 8), embedding rows held 512 "), line
        assert f"top-k ({2 + rank}, 8, 4), tail ({2 + rank}, 8)" in line, line
        error = float(re.search(r"whole teacher (\S+)$", line).group(1))
        assert error <= 1e-5, line
