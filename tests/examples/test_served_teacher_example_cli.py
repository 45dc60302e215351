"""The served-teacher example's command line as a new user runs it (examples/served_teacher_loop.py):
`--save-teacher DIR` writes the tiny teacher the docs serve on CPU (the served lane's own
checkpoint, byte for byte), a run that serves its own teacher says so before the server's start
(up to 2 minutes), and each step's line is printed when the step ends (`--pause` between steps: the time the
docs' replica run stops a replica in), not all at the end."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "served_teacher_loop.py"


def script(*argv: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLE), *argv], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"}, **kwargs)


def test_save_teacher_writes_the_served_lanes_checkpoint(tmp_path):
    """The docs' `--save-teacher /tmp/tiny-teacher` line: the directory the served lane serves (its
    config, weights and tokenizer the lane's `checkpoint`), so the lane's servers are the docs'."""
    pytest.importorskip("transformers", reason="the tiny teacher is written by transformers")
    from safetensors.torch import load_file

    from megatron_rl_patches.testing.hf_checkpoints import save_tiny_hf, save_word_tokenizer
    from tests.teachers.lane.served_kit import MODEL_SHAPE, VOCAB

    proc = script("--save-teacher", str(tmp_path / "tiny-teacher"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(f"{tmp_path / 'tiny-teacher'}: a tiny random Qwen3 teacher (1001 words"), proc.stdout
    lane = tmp_path / "lane"
    save_tiny_hf(lane, "qwen3", seed=3, **MODEL_SHAPE)  # as the served lane's conftest writes it
    save_word_tokenizer(lane, VOCAB)
    for name in ("config.json", "tokenizer.json"):
        assert json.loads((tmp_path / "tiny-teacher" / name).read_text()) == json.loads((lane / name).read_text())
    written, served = (load_file(d / "model.safetensors") for d in (tmp_path / "tiny-teacher", lane))
    assert written.keys() == served.keys() and all(written[k].equal(served[k]) for k in served)


def test_a_run_that_serves_its_own_teacher_says_so_before_the_server_starts(tmp_path):
    """`--vllm-python` starts a server that takes up to 2 minutes on CPU: a line says so first (here
    the interpreter is no vLLM, so the server exits at once and the run fails after the line)."""
    pytest.importorskip("transformers", reason="the tiny teacher is written by transformers")
    proc = script("--vllm-python", "/bin/false", "--steps", "1")
    assert proc.returncode != 0
    first = proc.stdout.splitlines()[0] if proc.stdout else ""
    said = "starting a vLLM server of the tiny teacher (up to 2 minutes on CPU; its log: "
    assert first.startswith(said), proc.stdout
    assert "exited with 1 before it was ready" in proc.stderr, proc.stderr[-2000:]


def test_each_steps_line_is_printed_when_the_step_ends():
    """Two steps of the in-process teacher with `--pause 4`: the header at once, step 0's line at
    least the pause before step 1's (printed as each step ends, the run still going)."""
    proc = subprocess.Popen([sys.executable, str(EXAMPLE), "--in-process", "--steps", "2", "--pause", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    lines = []
    try:
        for line in proc.stdout:
            lines.append((time.monotonic(), line.rstrip("\n")))
        assert proc.wait(timeout=600) == 0, proc.stderr.read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    texts = [text for _, text in lines]
    assert texts[0].startswith("student GPT (vocab 1001, padded to 1024) at TP=1, an in-process teacher's"), texts
    assert texts[1].split() == ["step", "loss", "rows"], texts
    steps = [(when, text.split()) for when, text in lines[2:]]
    assert [row[0] for _, row in steps] == ["0", "1"], texts
    assert steps[1][0] - steps[0][0] >= 3.5, steps  # step 0's line came before the pause, not with step 1's


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_a_bad_pause_is_a_usage_error(value):
    proc = script("--in-process", "--pause", value)
    assert proc.returncode == 2 and f"--pause takes seconds >= 0, got {value}" in proc.stderr, proc.stderr


def test_a_teacher_that_does_not_answer_ends_the_run_in_one_line_naming_it():
    """Issue 105 item 9: the wrong port had been named at the end of a 75-line traceback (the
    ranks' and the world's); now one line, the ranks' tracebacks with --traceback."""
    from tests.kit.ports import refused_port

    with refused_port() as port:
        proc = script("--url", f"http://127.0.0.1:{port}", "--steps", "1")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("served_teacher_loop.py: the run failed: ValueError: build_teachers: entry "
                           f"'http://127.0.0.1:{port}': served teacher failed on rank 0 of the group: "
                           f"ServedTeacherError: http://127.0.0.1:{port}/v1/models: no answer after "), line
    assert line.endswith("(ConnectError: [Errno 111] Connection refused) (--traceback: the ranks' tracebacks)"), line
