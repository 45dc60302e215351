"""`bench residency --quick`: every mode measured on a tiny GPTModel; the streamed modes hold less
than the resident build, layer-major copies each piece once per rollout (per micro-batch without
it), and the table, CSV and plot are written."""
from __future__ import annotations

import csv
import importlib.util

import pytest

# version-blind: the main lane only; each mode's peaks and copies are held on every megatron lane by
# tests/inference/residency and tests/inference/layer_major
pytestmark = [pytest.mark.megatron, pytest.mark.version_blind]


def test_quick_residency_bench_measures_every_mode(tmp_path, capsys):
    pytest.importorskip("megatron.core")
    from megatron_rl_patches.apps.bench.residency import MODES, QUICK
    from megatron_rl_patches.apps.cli import main

    assert main(["bench", "residency", "--quick", "--out", str(tmp_path)]) == 0
    assert "teacher residency: one rollout of 3 micro-batches" in capsys.readouterr().out
    rows = {row["mode"]: row for row in csv.DictReader(open(tmp_path / "residency.csv", newline=""))}
    assert list(rows) == list(MODES)
    resident = int(rows["resident"]["peak_device_weight_bytes"])
    assert resident == int(rows["resident"]["resident_weight_bytes"]) == int(rows["swap"]["peak_device_weight_bytes"])
    pieces = QUICK["layers"] + 2  # embedding, each layer, head
    assert int(rows["stream"]["copies"]) == QUICK["micro_batches"] * pieces
    assert int(rows["stream + layer-major"]["copies"]) == pieces and int(rows["swap"]["copies"]) == 1
    for mode in ("stream", "stream + layer-major"):
        assert int(rows[mode]["peak_device_weight_bytes"]) < resident
        assert rows[mode]["within_2_layers_head"] == "True"
    assert float(rows["stream + layer-major"]["activations_MiB"]) > 0 == float(rows["stream"]["activations_MiB"])
    assert "| stream + layer-major |" in (tmp_path / "residency.md").read_text()
    if importlib.util.find_spec("matplotlib") is not None:  # the [bench] extra
        assert (tmp_path / "residency.png").stat().st_size > 0
