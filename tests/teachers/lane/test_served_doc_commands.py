"""The docs' vLLM CPU server lines started as written (tests/docs/doc_servers.py finds them: each
`vllm serve` block's CPU line; the lane's interpreter for `python`, its checkpoint for `--model`, a
free port, nothing else changed, and none of the CPU backend's variables from this process: the
line's own prefix is what lets it start), each distinct line once, all at once; each answers its
route (prompt log-probs, or the pooling task at the head's width). Then docs/distillation.md's
whole-vocabulary block runs as written against the pooling line's server."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl_patches.testing.vllm_server import VllmServer, free_port, stop, wait_ready
from tests.teachers.lane.served_kit import VLLM_PYTHON

DOCS_TESTS = Path(__file__).resolve().parents[2] / "docs"


def doc_servers():
    sys.path.insert(0, str(DOCS_TESTS))
    try:
        import doc_blocks
        import doc_servers as found
    finally:
        sys.path.remove(str(DOCS_TESTS))
    return doc_blocks, found


@pytest.fixture(scope="module")
def started(checkpoint, tmp_path_factory):
    """{command as run: (its server, where the docs show it)}, every one ready."""
    _, directory, _ = checkpoint
    _, servers = doc_servers()
    logs = tmp_path_factory.mktemp("doc-servers")
    env = {name: value for name, value in os.environ.items()
           if not name.startswith("VLLM_") and name != "PYTHONPATH"}
    running: dict[str, tuple[VllmServer, list[str]]] = {}
    try:
        for n, (command, where) in enumerate(servers.distinct(VLLM_PYTHON, str(directory)).items()):
            port = free_port()
            line = servers.as_lane_runs(command, VLLM_PYTHON, str(directory), port)
            log = logs / f"server-{n}.log"
            with open(log, "wb") as out:
                process = subprocess.Popen(["bash", "-c", line], stdout=out, stderr=subprocess.STDOUT, env=env,
                                           start_new_session=True)
            running[line] = (VllmServer(f"http://127.0.0.1:{port}", process, log), where)
        for server, where in running.values():
            try:
                wait_ready(server, 600)
            except RuntimeError as error:
                raise AssertionError(f"the docs' CPU line at {where} did not start as written: {error}") from None
        yield running
    finally:
        for server, _ in running.values():
            stop(server.process)


def test_each_cpu_line_of_the_docs_starts_and_answers(started, checkpoint):
    from megatron_rl_patches.teachers import ServedTeacher

    _, directory, _ = checkpoint
    assert {"--runner pooling" in line for line in started} == {True, False}, list(started)  # both routes
    for line, (server, where) in started.items():
        head = str(directory) if "--runner pooling" in line else None
        with ServedTeacher(server.url, "vllm", top_k=20, head=head) as teacher:
            model = teacher.check()  # prompt log-probs at k = 20, or the pooling task at the head's width
        assert model.max_model_len == 256, (where, model)


def test_the_whole_vocabulary_block_of_distillation_md_runs_as_written(started, checkpoint):
    _, directory, _ = checkpoint
    blocks, _ = doc_servers()
    (block,) = [b for b in blocks.page_blocks(blocks.REPO / "docs" / "distillation.md")
                if b.lang == "python" and 'TeacherHead.from_hf("/ckpt/Qwen3-8B")' in b.text]
    (url,) = [server.url for line, (server, _) in started.items() if "--runner pooling" in line]
    text = block.text.replace("/ckpt/Qwen3-8B", str(directory)).replace("http://127.0.0.1:8000", url)
    assert text.count(str(directory)) == 1 and text.count(url) == 1
    exec(compile(text, block.where, "exec"), {"__name__": "__doc_block__"})  # noqa: S102 - the docs' own block
