"""The served-teacher example's parts that need no server (examples/served_teacher_loop.py; the
whole loop against a real vLLM server: tests/teachers/lane/test_served_example.py): the served rows
placed at the positions that predict their tokens, the padded vocabulary, bad arguments refused
before any world starts."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "served_teacher_loop.py"


@pytest.fixture(scope="module")
def example():
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(EXAMPLE.parent))
        yield importlib.import_module(EXAMPLE.stem)
    sys.modules.pop(EXAMPLE.stem, None)


def test_each_served_row_sits_where_megatron_predicts_its_token(example):
    sequences = [torch.arange(10, 16), torch.arange(20, 24)]  # lengths 6 and 4
    starts = [2, 3]  # rows: tokens 2..5 of the first, token 3 of the second
    served = [torch.full((4, example.K), 1) * torch.arange(4)[:, None] + 100, torch.full((1, example.K), 7)]
    out = example.placed(sequences, starts, served)
    assert out["tokens"].tolist() == [[10, 11, 12, 13, 14], [20, 21, 22, 0, 0]]  # inputs: all but the last id
    assert out["row_mask"].tolist() == [[False, True, True, True, True], [False, False, True, False, False]]
    assert torch.equal(out["ids"][0, 1:5], served[0]) and torch.equal(out["ids"][1, 2], served[1][0])
    # position p predicts token p + 1: the row scoring token start + r is at position start + r - 1
    for i, (ids, start) in enumerate(zip(sequences, starts)):
        positions = out["row_mask"][i].nonzero().flatten()
        assert (positions + 1).tolist() == list(range(start, len(ids)))


def test_the_vocabulary_is_padded_as_megatron_pads_it(example):
    assert [example.padded(1001, tp) for tp in (1, 2, 4)] == [1024, 1024, 1024]
    assert example.padded(1025, 2) == 1280


@pytest.mark.parametrize("kwargs, error, words", [
    ({"tp": 0}, ValueError, "tp must be >= 1, got 0"),
    ({"steps": 1.5}, TypeError, "steps must be an int, got float"),
    ({"vocab_size": 4}, ValueError, "vocab_size must be >= 8, got 4"),
    ({"pause": -1.0}, ValueError, "pause must be a finite number of seconds >= 0, got -1.0"),
    ({"pause": float("inf")}, ValueError, "pause must be a finite number of seconds >= 0, got inf"),
])
def test_bad_arguments_are_refused_before_any_world_starts(example, kwargs, error, words):
    arguments = {"url": "http://127.0.0.1:9", "vocab_size": 1001, **kwargs}
    with pytest.raises(error, match=words):
        example.main(**arguments)
    assert not torch.distributed.is_initialized()


def in_process_checks(inputs) -> dict:
    """`on_loss` of the in-process run: the step's loss recomputed in float64 from the student's whole
    logits (gathered over the tensor-parallel ranks) and the teacher's scores, and the teacher's
    buckets (its own top-k, best first, and the tail) summing to one."""
    from tests.teachers.lane.example_kit import bucket_kl, student_log_softmax

    (scores,) = inputs.every
    rows = student_log_softmax(inputs)
    kl, mass = [], []
    for i, (ids, start) in enumerate(zip(inputs.samples.sequences, inputs.samples.response_starts)):
        values, tail = scores.topk_log_probs[i], scores.tail_log_probs[i]
        kl.append(bucket_kl(rows[i, start - 1:len(ids) - 1], scores.topk_ids[i], values, tail))
        mass.append(values.exp().sum(1) + tail.exp())
        assert bool((scores.topk_log_probs[i][:, :-1] >= scores.topk_log_probs[i][:, 1:]).all())
        assert scores.token_log_probs[i].shape == (len(ids) - start,)
    return {"reference": float(torch.cat(kl).mean()), "mass": float((torch.cat(mass) - 1).abs().max())}


def test_an_in_process_teacher_alone_trains_at_two_ranks(example):
    """The example's in-process teacher on the teacher step without a server (`main(None, ...,
    in_process=True)`) at TP=2 (teacher and student sharded alike): each step's loss the float64
    bucket KL of the same scores from the student's whole logits, the buckets whole, the student
    moved; the samples added one by one. (1 and 2 ranks beside a served teacher:
    tests/teachers/lane/test_served_example.py.)"""
    records = example.main(None, 1001, tp=2, steps=2, in_process=True, on_loss=in_process_checks)
    assert [r["rows"] for r in records] == [sum(n - p for n, p in zip(example.LENGTHS, example.PROMPTS))] * 2
    for record in records:
        assert abs(record["loss"] - record["checked"]["reference"]) <= 1e-6, record
        assert record["checked"]["mass"] <= 1e-6, record
    assert records[0]["loss"] != records[1]["loss"]
    # the rollout's samples handed to the step one by one as produced (`TeacherStep.add`)
    assert [(r["teacher"]["adds"], r["teacher"]["samples"]) for r in records] == [(4, 4)] * 2


def test_no_teacher_is_refused_before_any_world_starts(example):
    with pytest.raises(ValueError, match="no teacher: pass a server's url, or in_process=True"):
        example.main(None, 1001)
    assert not torch.distributed.is_initialized()


def test_each_served_state_sits_where_megatron_predicts_its_token(example):
    """--head: sample i's state r (predicting the token at start_i + r) at position start_i + r - 1."""
    sequences = [torch.arange(10, 16), torch.arange(20, 24)]
    starts = [2, 3]
    states = [torch.arange(4.0)[:, None].expand(4, 3) + 1, torch.full((1, 3), 9.0)]
    out = example.placed_states(sequences, starts, states)
    assert out.shape == (2, 5, 3)
    assert torch.equal(out[0, 1:5], states[0]) and torch.equal(out[1, 2], states[1][0])
    assert not out[0, 0].any() and not out[1, [0, 1, 3, 4]].any()


@pytest.mark.parametrize("kwargs", [{"url": None, "in_process": True}, {"in_process": True}, {"head": ""},
                                    {"head": 3}])
def test_a_head_without_its_server_or_beside_in_process_is_refused(example, kwargs):
    arguments = {"url": "http://127.0.0.1:9", "vocab_size": 1001, "head": "/models/teacher", **kwargs}
    with pytest.raises(ValueError, match="the whole-vocabulary route takes the teacher's Hugging Face directory"):
        example.main(**arguments)
    assert not torch.distributed.is_initialized()


def test_the_readme_runs_the_example_with_the_package_venv_and_says_how_the_lane_is_built():
    """`python examples/served_teacher_loop.py` with a system Python has no torch: every command line
    of the example (README, docs, its docstring) names `.venv/bin/python`, and the README says how
    `.lanes/vllm` is built (a rule of the Makefile)."""
    import re

    root = EXAMPLE.parents[1]
    texts = {path: path.read_text() for path in [root / "README.md", *sorted((root / "docs").glob("*.md")), EXAMPLE]}
    runs = [(path.name, m.group(0)) for path, text in texts.items()
            for m in re.finditer(r"[\w./-]*python[\w.]* examples/served_teacher_loop\.py", text)]
    assert len(runs) >= 4 and all(run.startswith(".venv/bin/python ") for _, run in runs), runs
    makefile = (root / "Makefile").read_text()
    assert "VLLM_LANE = .lanes/vllm" in makefile and "VLLM_STAMP = $(VLLM_LANE)/.installed" in makefile
    assert "\nvllm-lane: $(VLLM_STAMP)\n" in makefile and "make vllm-lane" in texts[root / "README.md"]


def test_a_failover_is_printed_as_it_happens_and_in_the_steps_figures(example, capsys):
    """What the replica run shows a user (issue 96 item 0): the served teacher's warning line as it
    comes (stdout, beside the step lines), and under each step's line its figures."""
    import contextlib
    import logging

    with contextlib.ExitStack() as stack:
        example.warnings_printed(stack)
        logging.getLogger("megatron_rl_patches.teachers.served.scheduler").warning(
            "served teacher %s: replica %s taken out (refused)", "http://a|http://b", "http://b")
    logging.getLogger("megatron_rl_patches.teachers.served.scheduler").warning("after the run: not printed")
    figures = {"samples": 4, "retries": 2, "failovers": 1, "hedges_sent": 1, "hedges_won": 1, "taken_out": ["http://b"]}
    print(example.teacher_line(figures))
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["warning: served teacher http://a|http://b: replica http://b taken out (refused)",
                       "      teacher: samples 4, retries 2, failed over 1, hedges sent 1 / won 1, taken out: http://b"]
    assert example.teacher_line({**figures, "taken_out": []}).endswith("taken out: none")
