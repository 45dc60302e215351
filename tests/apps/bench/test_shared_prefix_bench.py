"""`bench shared-prefix --quick`: both routes of every case measured on a tiny GPTModel, the shared
route handed P + G·R tokens where the unshared one takes G·(P + R), keeping fewer activations for
backward, its log-probs those of the unshared route; the table, CSV and plot written."""
from __future__ import annotations

import csv
import importlib.util
import re

import pytest

pytestmark = pytest.mark.slow  # a GPTModel world: the main lane only


def test_quick_shared_prefix_bench_measures_both_routes(tmp_path, capsys):
    pytest.importorskip("megatron.core")
    from megatron_rl_patches.apps.bench.shared_prefix import QUICK, SHARED, UNSHARED
    from megatron_rl_patches.apps.bench.shared_prefix_peer import NOT_INSTALLED, PEER, PEER_UNSHARED, peer_installed
    from megatron_rl_patches.apps.cli import main

    assert main(["bench", "shared-prefix", "--quick", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr()
    assert "shared-prefix packing: GPTModel" in printed.out
    # a line per case as it ends (issue 110 item 10: the full benchmark was silent for 9 minutes)
    ended = [line for line in printed.err.splitlines() if line.startswith("  case ")]
    assert len(ended) == len(QUICK["cases"]), printed.err
    for i, (line, (p, r, g)) in enumerate(zip(ended, QUICK["cases"]), 1):
        said = (rf"  case {i}/2 done \(\d+\.\d s\): P={p}, R={r}, G={g}: the training step \d+\.\d\dx the "
                rf"unshared one's CPU time, {p + g * r} tokens for {g * (p + r)}")
        assert re.fullmatch(said, line), line
    every = list(csv.DictReader(open(tmp_path / "shared_prefix.csv", newline="")))
    rows = [row for row in every if row["packing"] in (UNSHARED, SHARED)]
    peer = [row for row in every if row not in rows]
    assert [row["packing"] for row in peer] == ([PEER_UNSHARED, PEER] if peer_installed() else [PEER]) * 2
    if not peer_installed():  # the peer's row says so, the bench goes on
        assert {row["note"] for row in peer} == {NOT_INSTALLED}
    assert [(row["case"], row["packing"]) for row in rows] == [
        (f"P={p}, R={r}, G={g}", route) for p, r, g in QUICK["cases"] for route in (UNSHARED, SHARED)]
    for (prompt, response, group), (plain, shared) in zip(QUICK["cases"], zip(rows[::2], rows[1::2])):
        assert int(plain["tokens"]) == group * (prompt + response)
        assert int(shared["tokens"]) == prompt + group * response
        assert float(plain["train_vs_unshared"]) == 1.0 and float(shared["train_ms"]) > 0
        assert float(shared["activations_MiB"]) < float(plain["activations_MiB"])  # the docs' "activations kept"
        assert float(shared["max_abs_diff"]) < 1e-5
    if importlib.util.find_spec("matplotlib") is not None:  # the [bench] extra
        assert (tmp_path / "shared_prefix.png").stat().st_size > 0


def test_the_attention_bench_checks_its_harness_on_cpu_and_wants_cuda_for_figures(tmp_path, capsys, monkeypatch):
    """On CPU its rows say no time and no ratio beside "no speed figure", and torch's advice to compile
    FlexAttention (a warning torch gives once a process: its record emptied here) is not printed."""
    import warnings

    import torch
    from torch.nn.attention import flex_attention

    from megatron_rl_patches.apps.bench.shared_prefix_attention import NO_SPEED, QUICK, routes
    from megatron_rl_patches.apps.cli import main

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the full benchmark (tools/gpu-check)")
    assert main(["bench", "shared-prefix-attention"]) != 0
    assert "needs a CUDA device" in capsys.readouterr().err
    monkeypatch.setattr(flex_attention, "_WARNINGS_SHOWN", set())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert main(["bench", "shared-prefix-attention", "--quick", "--out", str(tmp_path)]) == 0
    assert [str(w.message)[:60] for w in seen] == []
    rows = list(csv.DictReader(open(tmp_path / "shared_prefix_attention.csv", newline="")))
    p, r, g = QUICK["prompt"], QUICK["response"], QUICK["group"]
    assert [int(row["rows"]) for row in rows] == [g * (p + r), p + g * r]
    assert [(row["ms"], row["vs_unshared"], row["note"]) for row in rows] == [("", "", NO_SPEED)] * 2
    monkeypatch.setattr(flex_attention, "_WARNINGS_SHOWN", set())  # the negative control: the call alone advises
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        routes(QUICK, "cpu", torch.float32)["shared prefix (FlexAttention, block mask)"][1](False)
    assert any("torch.compile" in str(w.message) for w in seen)


def test_a_failed_measurement_is_one_row_saying_why_and_no_plot(tmp_path, monkeypatch, capsys):
    from megatron_rl_patches.apps.bench import shared_prefix

    def broken(plan):
        raise RuntimeError("no megatron-core here")

    monkeypatch.setattr(shared_prefix, "measure", broken)
    rows = shared_prefix.run(quick=True, out_dir=str(tmp_path))
    assert rows == [{"case": "all", "error": "RuntimeError: no megatron-core here",
                     "note": "error: no megatron-core here"}]
    assert "error: no megatron-core here" in capsys.readouterr().out
    assert list(csv.DictReader(open(tmp_path / "shared_prefix.csv", newline="")))[0]["note"] == \
        "error: no megatron-core here"
    assert not (tmp_path / "shared_prefix.png").exists()


def test_the_multi_turn_shape_measures_the_tree_against_the_one_level_plan(tmp_path):
    pytest.importorskip("megatron.core")
    from megatron_rl_patches.apps.bench.shared_prefix import MULTI_TURN_QUICK, ONE_LEVEL, SHARED, UNSHARED
    from megatron_rl_patches.apps.bench.shared_prefix_peer import peer_installed
    from megatron_rl_patches.apps.cli import main

    assert main(["bench", "shared-prefix", "--quick", "--shape", "multi-turn", "--out", str(tmp_path)]) == 0
    every = list(csv.DictReader(open(tmp_path / "shared_prefix_multi_turn.csv", newline="")))
    rows = [row for row in every if row["packing"] in (UNSHARED, ONE_LEVEL, SHARED)]
    assert [row["packing"] for row in rows] == [UNSHARED, ONE_LEVEL, SHARED] * 2
    assert len(every) == len(rows) + (4 if peer_installed() else 2)  # the peer's rows, or its "not installed"
    system, user, answer = (MULTI_TURN_QUICK[key] for key in ("system", "user", "assistant"))
    turn = user + answer
    branching, per_turn = rows[:3], rows[3:]
    # 4 final trajectories; one level: all 4 share the system prompt, turn 1 and the second user message;
    # the tree: then each of 2 second answers and its user message, then 4 third answers and turn 4
    shared = system + turn + user
    assert [int(row["tokens"]) for row in branching] == [4 * (system + 4 * turn), shared + 4 * (3 * turn - user),
                                                         shared + 2 * turn + 4 * (answer + turn)]
    assert [int(row["tokens"]) for row in per_turn] == [sum(system + k * turn for k in range(1, 5)),
                                                        system + turn + 3 * turn + 2 * turn + turn, system + 4 * turn]
    assert all(float(row["max_abs_diff"]) < 1e-5 for row in rows)
    assert main(["bench", "fused", "--quick", "--shape", "multi-turn"]) == 2


def test_the_model_shapes_measure_each_against_the_same_model_unshared(tmp_path, capfd):
    """`--shape models`: a gated-delta-net hybrid, a DeepSeek-shaped model and the dense one at CP = 2
    (two spawned ranks), each route's tokens, log-probs and activations against its own unshared row;
    the title names each vocabulary, and the CP ranks print no megatron-core notes (issue 119 item 8:
    ~30 lines of UserWarnings with absolute paths among the table's)."""
    pytest.importorskip("megatron.core")
    from megatron_rl_patches.testing.gdn_gpt import megatron_gated_delta_net_served

    if not megatron_gated_delta_net_served():
        pytest.skip("the hybrid row runs megatron-core 0.16's GatedDeltaNet (megatron.core.ssm.gated_delta_net)")
    from megatron_rl_patches.apps.bench.shared_prefix import SHARED, UNSHARED
    from megatron_rl_patches.apps.bench.shared_prefix_models import MODELS, QUICK, UNSHARED_NOTE, case_name
    from megatron_rl_patches.apps.cli import main

    assert main(["bench", "shared-prefix", "--quick", "--shape", "models", "--out", str(tmp_path)]) == 0
    printed = capfd.readouterr()
    ended = [line for line in printed.err.splitlines() if line.startswith("  case ")]
    assert [line.split("): ", 1)[1].split(":")[0] for line in ended] == list(MODELS)
    assert "Warning" not in printed.err and "site-packages" not in printed.err, printed.err[-2000:]
    vocab = f"vocab {QUICK['vocab']} (deepseek: {18 * QUICK['hidden']} (18 x hidden, DeepSeek-V3's proportion))"
    assert f"4 heads of 8, {vocab}, fp32" in printed.out
    rows = list(csv.DictReader(open(tmp_path / "shared_prefix_models.csv", newline="")))
    assert [(row["case"], row["packing"]) for row in rows] == [
        (case_name(model, QUICK), route) for model in MODELS for route in (UNSHARED, SHARED)]
    p, r, g = QUICK["case"]
    for model, plain, shared in zip(MODELS, rows[::2], rows[1::2]):
        assert plain["note"] == UNSHARED_NOTE[model]
        assert (int(plain["tokens"]), int(shared["tokens"])) == (g * (p + r), p + g * r)
        assert float(plain["train_vs_unshared"]) == 1.0 and float(shared["train_cpu_ms"]) > 0
        assert float(shared["activations_MiB"]) < float(plain["activations_MiB"])
        assert 0 < float(shared["max_abs_diff"]) < 1e-5, model  # computed another way, the same log-probs


def test_an_unknown_shape_is_refused_naming_every_shape():
    from megatron_rl_patches.apps.bench import (
        shared_prefix,
        shared_prefix_agentic,
        shared_prefix_models,
        shared_prefix_shapes,
    )
    from megatron_rl_patches.apps.cli.bench import BENCHMARKS

    # the CLI's choices (shared_prefix_shapes.ALL_SHAPES) are the shapes the two modules run, through one door
    assert set(shared_prefix_shapes.ALL_SHAPES) == {*shared_prefix.SHAPES, *shared_prefix_models.SHAPES,
                                                    *shared_prefix_agentic.SHAPES, "all"}
    assert BENCHMARKS["shared-prefix"] == shared_prefix_shapes.__name__

    with pytest.raises(ValueError, match="got 'tree'") as refused:
        shared_prefix_shapes.run(quick=True, shape="tree")
    assert all(shape in str(refused.value) for shape in shared_prefix_shapes.ALL_SHAPES)


def test_the_agentic_shape_computes_a_cut_group_once_per_step(tmp_path):
    """`--shape agentic`: a group the budget cuts and a sample per turn past it, packed whole, once per
    micro-batch and once per step through megatron-core's schedule: the step computes the samples'
    trie (its tokens), runs the held segments again in backward, and scores every sample as packed whole."""
    pytest.importorskip("megatron.core")
    from megatron_rl_patches.apps.bench.shared_prefix_agentic import QUICK, samples_of
    from megatron_rl_patches.apps.bench.shared_prefix_budgets import trie_size
    from megatron_rl_patches.apps.cli import main

    assert main(["bench", "shared-prefix", "--quick", "--shape", "agentic", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "shared_prefix_agentic.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert {row["packing"] for row in rows} == {"packed whole", "once per micro-batch", "once per step"}
    for case, samples, _ in samples_of(QUICK):
        got = {row["packing"]: row for row in rows if row["case"] == case}
        assert int(got["packed whole"]["tokens"]) == sum(len(s) for s in samples)
        assert int(got["once per step"]["tokens"]) == trie_size(samples) < int(got["once per micro-batch"]["tokens"])
        assert int(got["once per step"]["recomputed"]) > 0
        assert all(float(row["max_abs_diff"]) < 1e-5 for row in got.values())
    assert (tmp_path / "shared_prefix_agentic.png").exists()


def test_each_shape_says_its_own_time_before_it_runs(monkeypatch, capsys):
    """Issue 119 item 8: every shape said "about 6-9 min" (measured 0:54 to 7:07)."""
    from megatron_rl_patches.apps.bench import shared_prefix_shapes
    from megatron_rl_patches.apps.cli import main

    asked = []
    monkeypatch.setattr(shared_prefix_shapes, "run", lambda quick, out_dir, **options: asked.append(options) or [])
    said = {}
    for shape in (None, *shared_prefix_shapes.ALL_SHAPES):
        assert main(["bench", "shared-prefix", *(["--shape", shape] if shape else [])]) == 0
        (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("bench shared-prefix:")]
        said[shape] = line.split("running (about ", 1)[1].split(" on an idle 2-core CPU")[0]
    assert asked == [{}] + [{"shape": shape} for shape in shared_prefix_shapes.ALL_SHAPES]
    assert said == {None: said["grpo"], **shared_prefix_shapes.DURATIONS}
    assert said["grpo"].startswith("7 min") and said["multi-turn"].startswith("5 min") and said["models"] == "2-3 min"
    assert said["cp2"] == said["hybrid"] == said["deepseek"] == "1 min"


def test_a_models_title_says_the_vocabulary_each_model_uses():
    from megatron_rl_patches.apps.bench.shared_prefix_models import FULL, described

    assert "vocab 16384 (deepseek: 4608 (18 x hidden, DeepSeek-V3's proportion))," in described(
        FULL, ("hybrid", "deepseek", "cp2"))
    assert ", vocab 4608 (18 x hidden, DeepSeek-V3's proportion), fp32" in described(FULL, ("deepseek",))
    assert ", vocab 16384, fp32" in described(FULL, ("hybrid",)) and "deepseek" not in described(FULL, ("cp2",))
