"""The docs' vLLM CPU server lines started as written (tests/docs/doc_servers.py finds them: each
`vllm serve` block's CPU line; the lane's interpreter for vLLM's, its checkpoint for `--model`, a
free port, nothing else changed, and none of the CPU backend's variables from this process: the
line's own prefix is what lets it start), each distinct line once, all at once; each answers its
route (prompt log-probs, or the pooling task at the head's width). Then docs/distillation.md's
whole-vocabulary block runs as written against the pooling line's server, and the replica run of
docs/distillation.md (the README's until it became a first page) runs as written against two
replicas of the tiny teacher (the replicas' own line's server and the lane's server of the same
checkpoint, which is the docs' `--save-teacher` directory:
tests/examples/test_served_teacher_example_cli.py), one of them stopped by the block mid-run (last:
it stops that server)."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl_patches.testing.vllm_server import VllmServer, free_port, stop, wait_ready
from tests.teachers.lane.early_work import offer, server_job
from tests.teachers.lane.served_kit import VLLM_PYTHON

DOCS_TESTS = Path(__file__).resolve().parents[2] / "docs"
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
REPLICA_RUN = "examples/served_teacher_loop.py --url 'http://127.0.0.1:8001|http://127.0.0.1:8002'"
STEP = re.compile(r"^\s*(\d+)\s+(-?\d+\.\d+)\s+(\d+)$")


def doc_servers():
    sys.path.insert(0, str(DOCS_TESTS))
    try:
        import doc_blocks
        import doc_servers as found
    finally:
        sys.path.remove(str(DOCS_TESTS))
    return doc_blocks, found


def begin_doc_servers(root: Path, directory: Path) -> dict[str, tuple[VllmServer, list[str]]]:
    """{command as run: (its server, where the docs show it)}, every one started (not waited for)."""
    _, servers = doc_servers()
    logs = root / "doc-servers"
    logs.mkdir(exist_ok=True)
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
    except BaseException:
        stop_doc_servers(running)
        raise
    return running


def servers_of(running: dict[str, tuple[VllmServer, list[str]]]) -> list[VllmServer]:
    return [server for server, _ in running.values()]


def stop_doc_servers(running: dict[str, tuple[VllmServer, list[str]]]) -> None:
    for server in servers_of(running):
        stop(server.process)


# the docs' servers load while the lane's other tests run (early_work); about 2 GB each
offer("doc servers", server_job(__name__, len(doc_servers()[1].distinct("python", "model")), begin_doc_servers,
                                servers_of))


@pytest.fixture(scope="module")
def started(early_work):
    """{command as run: (its server, where the docs show it)}, every one ready."""
    running = early_work.take("doc servers")
    try:
        for server, where in running.values():
            try:
                wait_ready(server, 600)
            except RuntimeError as error:
                raise AssertionError(f"the docs' CPU line at {where} did not start as written: {error}") from None
        yield running
    finally:
        stop_doc_servers(running)


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


def test_the_replica_servers_block_keeps_each_replicas_process_id():
    servers, run, _ = replica_blocks()
    assert "\nA=$!\n" in servers.text and "\nB=$!\n" in servers.text
    assert run.text.rstrip().endswith("kill $A  # replica a, done")


def replica_blocks() -> tuple:
    """(the servers block, the run block, the output block) of the replica run, the same on each page
    that shows it (docs/distillation.md; README.md links it)."""
    blocks, _ = doc_servers()
    shown = {}
    for page in ("docs/distillation.md",):
        found = blocks.page_blocks(blocks.REPO / page)
        (i,) = [n for n, block in enumerate(found) if REPLICA_RUN in block.text]
        shown[page] = found[i - 1:i + 2]
    first, *others = shown.values()
    assert all([b.text for b in other] == [b.text for b in first] for other in others), "the pages show other runs"
    return tuple(first)


def steps(text: str) -> list[tuple[int, float, int]]:
    return [(int(m.group(1)), float(m.group(2)), int(m.group(3))) for m in map(STEP.match, text.splitlines()) if m]


def test_the_replica_run_of_the_docs_runs_as_written_one_replica_stopped_mid_run(started, served, tmp_path):
    """The run block as pasted (the package's interpreter for `.venv/bin/python`, the two replicas'
    URLs the lane's): replica b is the server of the replicas' own CPU line, which the block stops
    (`kill $B`) once step 1's line is out; the run goes on with replica a and prints what the docs
    show, every loss within 2e-4 (the shown numbers are a run against one server)."""
    servers, run, shown = replica_blocks()
    (replica_b,) = [server for server, where in started.values() if servers.where in where]
    text = (run.text.replace(".venv/bin/python", sys.executable).replace("examples/", f"{EXAMPLES}/")
            .replace("http://127.0.0.1:8001", served.url).replace("http://127.0.0.1:8002", replica_b.url))
    assert text.count(served.url) == 1 and text.count(replica_b.url) == 1
    # replica a is the lane's shared server: the block's last line stops a stand-in for it (issue 105 item 9: the
    # block kept b's process id alone, and replica a ran on after it)
    replica_a = subprocess.Popen(["sleep", "600"])
    try:
        proc = subprocess.run(["bash", "-c", text], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "A": str(replica_a.pid), "B": str(replica_b.process.pid),
                                   "PYTHONWARNINGS": "ignore"})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert replica_b.process.wait(60) is not None  # stopped by the block
        assert replica_a.wait(60) == -signal.SIGTERM  # and replica a, once the run is done
    finally:
        replica_a.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(replica_b.process.pid, signal.SIGKILL)  # its engine core too
    printed, expected = proc.stdout.splitlines(), shown.text.splitlines()
    assert printed[:2] == expected[:2], printed  # the header: two replicas
    stopped = "replica b (port 8002) stopped"
    assert printed.index(stopped) == expected.index(stopped), printed  # after steps 0 and 1 (and their figures)
    assert [n for n, _, _ in steps("\n".join(printed[:printed.index(stopped)]))] == [0, 1], printed
    # the failover as a user sees it (the default settings: hedging on): one warning naming b, and
    # the step's figures listing it taken out; the next step's list nothing more
    after = printed[printed.index(stopped):]
    warned = [line for line in after if line.startswith("warning: ") and replica_b.url in line]
    assert len(warned) == 1 and "taken out" in warned[0], printed
    figures = [line for line in after if line.strip().startswith("teacher:")]
    assert len(figures) == 2 and f"taken out: {replica_b.url}" in figures[0], printed
    assert "failed over 0," not in figures[0] and figures[1].endswith("taken out: none"), printed
    got, want = steps(proc.stdout), steps(shown.text)
    assert [(n, rows) for n, _, rows in got] == [(n, rows) for n, _, rows in want] and len(got) == 4, printed
    assert [loss for _, loss, _ in got] == pytest.approx([loss for _, loss, _ in want], abs=2e-4), printed
    print("\n".join(printed))
