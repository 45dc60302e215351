"""tools/serve_teacher_bench.py without vLLM (the served lane and the bench itself run the servers):
the models it serves (the tiny one unchanged, a wider one in Qwen3's proportions, a width it cannot
split refused), and its measuring: both servers asked for every group, the order turning from group
to group so a drifting load weighs on both alike, each server's tokens read around its own groups."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("serve_teacher_bench", REPO / "tools" / "serve_teacher_bench.py")
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules.setdefault(_spec.name, bench)
_spec.loader.exec_module(bench)


def test_the_tiny_model_is_the_earlier_runs_and_a_wide_one_has_qwen3s_proportions():
    assert bench.model_shape(64, 2) == dict(hidden_size=64, head_dim=32, intermediate_size=96, num_hidden_layers=2,
                                            vocab_size=bench.VOCAB)
    assert bench.model_shape(512, 4) == dict(hidden_size=512, head_dim=64, num_attention_heads=8,
                                             num_key_value_heads=2, intermediate_size=1536, num_hidden_layers=4,
                                             vocab_size=bench.VOCAB)
    with pytest.raises(ValueError, match="--hidden must be a multiple of 64"):
        bench.model_shape(300, 4)


def test_each_group_is_scored_by_both_servers_in_turning_order(monkeypatch):
    asked: list[tuple[str, int]] = []
    counters = {"http://stock": 0.0, "http://ours": 0.0}

    class FakeTeacher:
        def __init__(self, url, **_):
            self.url = url

        def __enter__(self):
            return self

        def __exit__(self, *_):
            return False

        def score(self, batch):
            asked.append((self.url, int(batch.sequences[0][0])))
            counters[self.url] += 10.0 if self.url == "http://stock" else 3.0

    monkeypatch.setattr(bench, "ServedTeacher", FakeTeacher)
    monkeypatch.setattr(bench, "computed", lambda url: counters[url])
    found = bench.measure({"stock vLLM": "http://stock", "serve-teacher": "http://ours"}, Path("."), (4, 2, 2), 3,
                          states=False)
    urls = [url for url, _ in asked]
    assert urls[:2] == ["http://stock", "http://ours"]  # the warm group, once each
    assert urls[2:] == ["http://stock", "http://ours", "http://ours", "http://stock", "http://stock", "http://ours"]
    timed = [first for _, first in asked[2:]]
    assert timed[0] == timed[1] and timed[2] == timed[3] and timed[4] == timed[5]  # the same group for both
    assert len({timed[0], timed[2], timed[4]}) == 3  # fresh prompts each turn
    assert found["stock vLLM"]["tokens"] == 10.0 and found["serve-teacher"]["tokens"] == 3.0
    for name in found:  # each group's time kept in the groups' order, for the ratio of each pair
        assert len(found[name]["times"]) == 3 and found[name]["best"] == min(found[name]["times"])


def test_block_runs_read_their_shapes_and_a_servers_cpu_with_its_children(tmp_path):
    """`--blocks` (issue 105 item 8): `--shapes` P/R/G joined by ',' (default: the issue's two), the
    CPU seconds of a process and its children (a server and vLLM's engine core), and the rows written."""
    import os
    import subprocess
    import types

    assert bench.shapes_of("96/24/8,1024/128/8") == [(96, 24, 8), (1024, 128, 8)]
    assert bench.shapes_of(None) == list(bench.SHAPES)
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.3\n"
                              "while time.process_time() < end: pass\ntime.sleep(30)"])
    try:
        import time

        time.sleep(1.0)
        mine = sum(os.times()[:2])
        assert bench.server_cpu(os.getpid()) >= mine + 0.25  # this process and its busy child
    finally:
        child.kill()
    args = types.SimpleNamespace(states=False, hidden=64, layers=2)
    bench.written(tmp_path / "out" / "rows", args, ["1 2 3", "4 5 6"], [{"P": 1}], ["| a |", "|---|"])
    assert (tmp_path / "out" / "rows.md").read_text().startswith("| a |\n|---|\n\n")
    assert '"P": 1' in (tmp_path / "out" / "rows.json").read_text()
