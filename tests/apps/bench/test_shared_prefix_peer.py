"""`bench shared-prefix`'s peer (PrefixGrouper on transformers' Qwen3): at a tiny shape its rows run
where `prefix_grouper` is importable (the bench lane, .lanes/bench-peer), PrefixGrouper handed one
prefix plus each sample's suffix, its log-probs those of its own unshared baseline; where it is not
importable the bench's row says "not installed" and nothing fails."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from megatron_rl_patches.apps.bench import shared_prefix_peer as peer_module

PEER_LANE = Path(__file__).resolve().parents[3] / ".lanes" / "bench-peer"
TINY = {"layers": 1, "hidden": 32, "heads": 4, "groups": 2, "vocab": 64, "rounds": 1, "cases": ((12, 4, 3),),
        "system": 6, "user": 2, "assistant": 3, "branches": (1, 2, 1)}


def test_without_prefix_grouper_the_row_says_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "prefix_grouper", None)  # import fails, find_spec answers None
    assert not peer_module.peer_installed()
    assert peer_module.peer_of(TINY) is None
    assert peer_module.peer_rows(None, "P=12, R=4, G=3", None) == [
        {"case": "P=12, R=4, G=3", "packing": peer_module.PEER, "note": peer_module.NOT_INSTALLED}]


def test_the_grouped_layout_keeps_each_scored_row_and_position():
    pytest.importorskip("torch")
    from megatron_rl_patches.apps.bench.shared_prefix import turns_batch

    batch = turns_batch(TINY, per_turn=True)  # one sample per turn: each the previous one's prefix, grown
    samples = peer_module.Samples.of_batch(batch)
    layout = peer_module.grouped_layout(samples)
    prefix = samples.prefix()
    assert prefix == len(samples.ids[0]) - 1  # the first sample whole but its last token: a suffix each
    assert layout.group_info == [[prefix, *(len(s) - prefix for s in samples.ids)]]
    stream = layout.ids[0].tolist()
    positions = layout.positions[0].tolist()
    read = iter(zip(layout.rows.tolist(), layout.targets.tolist()))
    for sample, scored in zip(samples.ids, samples.scored):
        for j in scored:  # the stream's row read for sample position j holds its token at its own position
            row, target = next(read)
            assert (stream[row], positions[row], target) == (sample[j], j, sample[j + 1])
    assert next(read, None) is None


@pytest.mark.slow  # transformers' import and two tiny models' steps (where the bench lane's package is importable)
@pytest.mark.parametrize("per_turn", [False, True], ids=["grpo-group", "suffixes-of-several-lengths"])
def test_the_peer_rows_run_where_prefix_grouper_is_importable(per_turn, monkeypatch):
    if PEER_LANE.is_dir():  # the main lane installs it there (the Makefile's test-main), as `make bench` does
        monkeypatch.syspath_prepend(str(PEER_LANE))
    pytest.importorskip("prefix_grouper", reason="the bench lane's package (.lanes/bench-peer: make bench) is not "
                                                 "installed here")
    pytest.importorskip("transformers")
    import torch

    from megatron_rl_patches.apps.bench.shared_prefix import micro_batch, turns_batch

    torch.set_num_threads(1)
    batch = turns_batch(TINY, per_turn=True) if per_turn else micro_batch(12, 4, 3, TINY["vocab"])
    unshared, grouped = peer_module.Peer(TINY).rows("tiny", batch)
    assert (unshared["packing"], grouped["packing"]) == (peer_module.PEER_UNSHARED, peer_module.PEER)
    samples = peer_module.Samples.of_batch(batch)
    prefix = samples.prefix()
    assert unshared["tokens"] == sum(len(s) for s in samples.ids)
    assert grouped["tokens"] == prefix + sum(len(s) - prefix for s in samples.ids) < unshared["tokens"]
    assert unshared["train_vs_unshared"] == 1.0 and grouped["train_cpu_ms"] > 0
    assert grouped["activations_MiB"] < unshared["activations_MiB"]
    assert grouped["max_abs_diff"] < 1e-5  # PrefixGrouper's log-probs are the samples' own
