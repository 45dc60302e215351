"""The worked shared-prefix example (examples/shared_prefix_cpu.py), run as pasted (a fresh
interpreter, the docs' command) and in process: the micro-batches fit their budget in computed
tokens, the prompt is computed once per micro-batch (fewer tokens than packed), and the training
step's loss and every gradient equal the step with each sample packed whole; a budget too small for
one sample is refused by name."""
from __future__ import annotations

import importlib.util
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


def test_the_step_packed_by_shared_prefix_equals_the_step_packed_whole(example, capsys):
    result = example.main(["--groups", "3", "--group-size", "4", "--prompt", "40", "--response", "6",
                           "--max-tokens", "80"])
    assert abs(result["loss"] - result["whole_loss"]) <= 1e-6 * max(1.0, abs(result["whole_loss"]))
    assert result["worst"] < 2e-6
    assert result["computed"] < result["packed"] / 2
    out = capsys.readouterr().out
    assert "micro-batches: 3 of at most 80 computed tokens (12 samples)" in out


def test_the_command_runs_as_pasted():
    done = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "gradients equal within 2e-6: True" in done.stdout


def test_a_budget_smaller_than_a_sample_is_refused(example):
    with pytest.raises(ValueError, match=r"more than max_tokens=20"):
        example.main(["--max-tokens", "20"])
