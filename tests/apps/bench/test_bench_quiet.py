"""`bench reentrant --quick` prints its table (saying --quick) and that --out DIR writes files,
not megatron-core's notes that Transformer Engine and Apex are not installed (4-7 UserWarnings on
a CPU machine; the demo already hid them)."""
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.megatron, pytest.mark.slow]


def test_bench_reentrant_hides_megatron_import_notes(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEGATRON_RL_PATCHES", "PYTHONWARNINGS"))}
    proc = subprocess.run([sys.executable, "-m", "megatron_rl_patches", "bench", "reentrant", "--quick"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "re-entrant patches" in proc.stdout and "[--quick: tiny shapes" in proc.stdout
    assert proc.stdout.rstrip().endswith("no files written: add --out DIR for CSV files and PNG plots")
    assert "Transformer Engine" not in proc.stderr and "Apex is not installed" not in proc.stderr, proc.stderr[-2000:]
