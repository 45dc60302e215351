"""The vLLM server commands of README.md and docs/*.md: every `vllm serve` block's CPU line (vLLM's
CPU build, started as a module by its own interpreter, `.lanes/vllm/bin/python` as `make vllm-lane`
builds it), each command as one line (its `\\` continuations joined, a
trailing `> LOG 2>&1 &` aside), and the form the served lane runs it in (the interpreter, the model
and the port its own: `as_lane_runs`)."""
from __future__ import annotations

import re
import shlex

from doc_blocks import Block, all_blocks

CPU_SERVER = "python -m vllm.entrypoints.openai.api_server"
GPU_SERVER = re.compile(r"(^|\s)vllm serve\s")
# what every CPU line starts with: vLLM's CPU backend refuses to start without a KV-cache size it can
# hold, and pins OpenMP threads to cores unless told not to
CPU_PREFIX = "VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind "
# the interpreter of vLLM's CPU build, its own venv, as the Makefile builds it (`make vllm-lane`)
VLLM_INTERPRETER = ".lanes/vllm/bin/python"
BACKGROUND = re.compile(r"(\s+>\s*\S+(\s+2>&1)?)?\s+&$")  # `> LOG 2>&1 &`: started in the background


def commands(block: Block) -> list[str]:
    """The block's shell commands, one line each (continuations joined, comments dropped)."""
    joined, lines = "", []
    for raw in block.text.splitlines():
        line = raw.rstrip()
        if not joined and line.lstrip().startswith("#"):
            continue
        joined += line[:-1] + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            if joined.strip():
                lines.append(" ".join(joined.split()))
            joined = ""
    return lines


def server_blocks() -> list[Block]:
    """The blocks that start a vLLM server, except those beside a trainer on GPUs (their skip
    reason says "on GPUs")."""
    return [block for block in all_blocks() if block.lang in ("bash", "sh", "console", "")
            and any(GPU_SERVER.search(c) or CPU_SERVER in c for c in commands(block))
            and "on GPUs" not in block.detail]


def cpu_lines(block: Block) -> list[str]:
    """The block's CPU server lines, each without a trailing `> LOG 2>&1 &`."""
    return [BACKGROUND.sub("", command) for command in commands(block) if CPU_SERVER in command]


def interpreter(command: str) -> str:
    """The interpreter a CPU line starts vLLM's module with (the word before `-m`)."""
    words = shlex.split(command)
    return words[words.index("-m") - 1]


def as_lane_runs(command: str, python: str, model: str, port: int) -> str:
    """`command` with the lane's interpreter for vLLM's (the word before `-m`), its checkpoint for
    `--model` and a free port for `--port` (nothing else changed)."""
    words = shlex.split(command)
    out = []
    for i, word in enumerate(words):
        if word.endswith("python") and words[i + 1:i + 2] == ["-m"]:
            word = python
        elif i and words[i - 1] == "--model":
            word = model
        elif i and words[i - 1] == "--port":
            word = str(port)
        out.append(word)
    return shlex.join(out)


def distinct(python: str, model: str) -> dict[str, list[str]]:
    """Each distinct CPU command (the model and port aside) -> where the docs show it."""
    found: dict[str, list[str]] = {}
    for block in server_blocks():
        for command in cpu_lines(block):
            found.setdefault(as_lane_runs(command, python, model, 0), []).append(block.where)
    return found
