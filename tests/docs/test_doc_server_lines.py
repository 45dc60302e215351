"""Every block of the docs that starts a vLLM server (outside a GPU trainer's command) holds a line
that runs as pasted on vLLM's CPU build: the module started with the CPU backend's settings in
front (without them it stops at start-up: "Available memory ... less than desired CPU memory
utilization"), by vLLM's own interpreter (`.lanes/vllm/bin/python`: the package's `python` has no vLLM),
a pooling line for a pooling block. The served lane starts each of those lines as
written (tests/teachers/lane/test_served_doc_commands.py)."""
from __future__ import annotations

import shlex

import pytest
from doc_servers import CPU_PREFIX, VLLM_INTERPRETER, as_lane_runs, commands, cpu_lines, interpreter, server_blocks

BLOCKS = server_blocks()


def test_the_docs_have_server_blocks():
    assert len(BLOCKS) >= 4, [b.where for b in BLOCKS]


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_each_server_block_has_a_cpu_line_that_starts_as_pasted(block):
    lines = cpu_lines(block)
    assert lines, f"{block.where}: a vLLM server block without a CPU line (vLLM's CPU build: {CPU_PREFIX}python -m ...)"
    for line in lines:
        assert line.startswith(CPU_PREFIX), f"{block.where}: {line!r} does not start with {CPU_PREFIX!r}"
    if "--runner pooling" in block.text:
        assert any("--runner pooling" in line for line in lines), \
            f"{block.where}: a pooling block without a CPU pooling line"


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_each_cpu_line_starts_vllm_with_the_interpreter_of_its_cpu_build(block):
    """A new user pasted `python -m vllm...` and got the package's interpreter, which has no vLLM."""
    assert [interpreter(line) for line in cpu_lines(block)] == [VLLM_INTERPRETER] * len(cpu_lines(block)), block.where


def test_the_lane_runs_each_cpu_line_with_its_own_interpreter_model_and_port():
    line = (f"{CPU_PREFIX}{VLLM_INTERPRETER} -m vllm.entrypoints.openai.api_server --model /tmp/tiny-teacher "
            "--max-model-len 256 --host 127.0.0.1 --port 8001")
    assert as_lane_runs(line, "/lane/python", "/lane/ckpt", 5) == (
        f"{CPU_PREFIX}/lane/python -m vllm.entrypoints.openai.api_server --model /lane/ckpt --max-model-len 256 "
        "--host 127.0.0.1 --port 5")


SAVE_TEACHER = ".venv/bin/python examples/served_teacher_loop.py --save-teacher "


def test_the_any_loop_recipe_serves_a_teacher_small_enough_for_cpu_and_says_how_to_make_it():
    """recipes.md's "A teacher served by vLLM (any loop)": its CPU lines serve the directory the line
    above them writes (the example's tiny teacher); a new user found no model small enough for CPU."""
    start = _heading_line("## A teacher served by vLLM")
    section = [b for b in BLOCKS if b.page == "docs/recipes.md" and b.line > start]
    assert len(section) == 2, [b.where for b in section]
    (save,) = [c for c in commands(section[0]) if c.startswith(SAVE_TEACHER)]
    directory = save.removeprefix(SAVE_TEACHER)
    for block in section:
        assert [_model(line) for line in cpu_lines(block)] == [directory], block.where


def test_the_tiny_teacher_line_runs_as_written(tmp_path):
    """The recipe's `--save-teacher` line run as pasted (the package's interpreter for `.venv/bin/python`,
    a temporary directory for its own): a Hugging Face directory vLLM's CPU build serves."""
    import json
    import subprocess
    import sys

    from doc_blocks import REPO

    pytest.importorskip("transformers", reason="the tiny teacher is written by transformers")
    (save,) = {c for b in BLOCKS for c in commands(b) if c.startswith(SAVE_TEACHER)}  # one line, on every page
    directory = save.removeprefix(SAVE_TEACHER)
    line = save.replace(".venv/bin/python", sys.executable).replace(directory, str(tmp_path / "teacher"))
    proc = subprocess.run(shlex.split(line), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((tmp_path / "teacher" / "config.json").read_text())
    assert (config["model_type"], config["vocab_size"], config["head_dim"]) == ("qwen3", 1001, 32)
    assert all((tmp_path / "teacher" / name).is_file() for name in ("tokenizer.json", "model.safetensors"))


def _heading_line(prefix: str) -> int:
    from doc_blocks import REPO

    lines = (REPO / "docs" / "recipes.md").read_text(encoding="utf-8").splitlines()
    return next(i + 1 for i, line in enumerate(lines) if line.startswith(prefix) and "(any loop)" in line)


def _model(line: str) -> str:
    words = shlex.split(line)
    return words[words.index("--model") + 1]
