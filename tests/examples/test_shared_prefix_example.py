"""The worked shared-prefix example (examples/shared_prefix_cpu.py), run as pasted (a fresh
interpreter, the docs' command): the micro-batches fit their budget in computed tokens, the prompt is
computed once per micro-batch (fewer tokens than packed), and the training step's loss and every
gradient equal the step with each sample packed whole; a budget too small for one sample is refused
by name (in process)."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.megatron, pytest.mark.reader_facing]  # main and newest lanes

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "shared_prefix_cpu.py"


@pytest.fixture(scope="module")
def example():
    pytest.importorskip("megatron.core")
    spec = importlib.util.spec_from_file_location("shared_prefix_cpu", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_command_runs_as_pasted():
    done = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "micro-batches: 2 of at most 200 computed tokens (16 samples)"
    assert lines[1] == "tokens computed: 329 for 1673 packed (5.1x fewer)"  # the prompt once per micro-batch
    loss, whole = (float(x) for x in re.findall(r"\d+\.\d{5}", lines[2]))
    assert abs(loss - whole) <= 1e-6 * max(1.0, abs(whole))
    assert lines[2].endswith("gradients equal within 2e-6: True")


def test_a_budget_smaller_than_a_sample_is_refused(example):
    with pytest.raises(ValueError, match=r"more than max_tokens=20"):
        example.main(["--max-tokens", "20"])
