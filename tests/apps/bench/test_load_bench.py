"""`bench load --quick`: the three sides (a plain read, build_inference_model_from_hf, transformers'
from_pretrained) each load the same random checkpoint in a fresh process; the table, CSV and plot
are written and the checkpoint folder is deleted afterwards."""
from __future__ import annotations

import csv
import importlib.util
import tempfile
from pathlib import Path

import pytest

# version-blind: the main lane only; the build's host memory it measures is held on every megatron lane
# by tests/inference/loading/hf/test_hf_load_memory.py
pytestmark = [pytest.mark.megatron, pytest.mark.version_blind, pytest.mark.slow]


def test_quick_load_bench_measures_every_side(tmp_path, capsys):
    pytest.importorskip("megatron.core")
    pytest.importorskip("transformers")
    from megatron_rl_patches.apps.bench.hf_load import SIDES
    from megatron_rl_patches.apps.cli import main

    before = set(Path(tempfile.gettempdir()).glob("hf-load-bench-*"))
    assert main(["bench", "load", "--quick", "--out", str(tmp_path)]) == 0
    assert "Hugging Face checkpoint load" in capsys.readouterr().out
    assert set(Path(tempfile.gettempdir()).glob("hf-load-bench-*")) == before  # the checkpoint is gone
    rows = {row["side"]: row for row in csv.DictReader(open(tmp_path / "hf_load.csv", newline=""))}
    assert list(rows) == list(SIDES)
    assert all(not row.get("error") for row in rows.values())
    assert float(rows["transformers"]["vs_transformers"]) == 1.0
    checkpoint = float(rows["plain read"]["checkpoint_GB"])
    assert checkpoint > 0.05
    # the build holds the weights: at least the checkpoint above its start; the plain read far less
    assert float(rows["megatron-rl-patches"]["above_start_GB"]) > 0.9 * checkpoint
    assert float(rows["plain read"]["above_start_GB"]) < 0.5 * float(rows["megatron-rl-patches"]["above_start_GB"])
    if importlib.util.find_spec("matplotlib") is not None:  # the [bench] extra
        assert (tmp_path / "hf_load.png").stat().st_size > 0
