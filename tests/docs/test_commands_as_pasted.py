"""Commands run as pasted (issue 110 item 10): a reader who built the clone's environment as the
README says (`make venv` / `make demo`: `.venv`) and pastes a command into a fresh shell has no
environment on PATH, so every page and example writes a command of the clone with it
(`.venv/bin/python examples/...`, `.venv/bin/megatron-rl-patches bench ...`) and the README says so.
The docs test runs the `$ ` commands so (doc_shell.py); here: its reader's shell is one (a bare
command fails there, the `.venv/bin/` one runs), and no page or example docstring writes a command of
the clone bare."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from doc_blocks import REPO, doc_pages  # noqa: E402
from doc_shell import clone_root, paste, reader_environ  # noqa: E402

pytestmark = pytest.mark.reader_facing  # the main and newest lanes (docs/testing.md, "Where a test runs")

# a command only a clone runs (its examples, tools and tests; the benchmarks and the demo), written
# without an environment's interpreter: `python examples/x.py`, `megatron-rl-patches bench`
BARE = re.compile(r"(?<![\w/.-])(?:python3?|megatron-rl-patches)\s+(?:examples/|tools/|tests/|bench\b|demo\b)")
# docs/design.md is the lead's page: its one bare command (`python tools/doc_families.py`) is theirs to fix
NOT_CHECKED = ("docs/design.md",)


def bare_commands(text: str) -> list[str]:
    """The lines of `text` that write a command of the clone without the clone's environment."""
    return [line.strip() for line in text.splitlines() if BARE.search(line)]


def test_a_bare_command_is_found_and_a_prefixed_one_is_not():
    assert bare_commands("run `python examples/shared_prefix_cpu.py`\n$ megatron-rl-patches bench shared-prefix\n"
                         "PYTHONPATH=. python tools/x.py\n") == [
        "run `python examples/shared_prefix_cpu.py`", "$ megatron-rl-patches bench shared-prefix",
        "PYTHONPATH=. python tools/x.py"]
    assert bare_commands("`.venv/bin/python examples/x.py`, `.venv/bin/megatron-rl-patches bench --quick`, "
                         "`.lanes/vllm/bin/python -m vllm`, `megatron-rl-patches doctor`\n") == []


def test_no_page_writes_a_command_of_the_clone_bare():
    found = {}
    for path in doc_pages():
        page = path.relative_to(REPO).as_posix()
        if page not in NOT_CHECKED and bare_commands(path.read_text(encoding="utf-8")):
            found[page] = bare_commands(path.read_text(encoding="utf-8"))
    assert found == {}, f"commands that fail when pasted (write them `.venv/bin/python ...`): {found}"


def test_no_example_docstring_writes_its_command_bare():
    found = {}
    for path in sorted((REPO / "examples").glob("*.py")):
        docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        assert f"examples/{path.name}" in docstring, f"{path.name}: its docstring never says how to run it"
        if bare_commands(docstring):
            found[path.name] = bare_commands(docstring)
    assert found == {}, found


def test_the_readme_says_how_the_pages_write_commands():
    text = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    assert "Commands on these pages" in text
    assert "`.venv/bin/python examples/" in text and "`. .venv/bin/activate`" in text


def test_the_readers_shell_has_no_environment_on_path():
    bin_dir = os.path.join(sys.prefix, "bin")
    given = {"PATH": os.pathsep.join([bin_dir, "/elsewhere/.venv-mcore019/bin", "/usr/bin"]),
             "VIRTUAL_ENV": "/elsewhere/.venv", "MEGATRON_RL_PATCHES": "all", "HOME": "/root"}
    assert reader_environ(given) == {"PATH": "/usr/bin", "HOME": "/root"}


@pytest.mark.parametrize(("command", "fails"), [("megatron-rl-patches list --json", True),
                                                (".venv/bin/megatron-rl-patches list --json", False)])
def test_a_bare_command_fails_as_pasted_and_the_clones_runs(command, fails, tmp_path):
    pasted = paste("p.md:1", command, clone_root(tmp_path))
    if fails:
        with pytest.raises(AssertionError, match=r"(?s)p\.md:1: .*fails as pasted.*exit 127.*command not found"):
            pasted.finish()
    else:
        assert pasted.finish().lstrip().startswith(("[", "{"))


def test_the_clone_root_is_the_repository_with_this_environment_as_its_venv(tmp_path):
    root = clone_root(tmp_path)
    assert (root / ".venv").resolve() == Path(sys.prefix).resolve()
    assert (root / "examples" / "shared_prefix_cpu.py").resolve() == (REPO / "examples" / "shared_prefix_cpu.py")
    done = subprocess.run(["bash", "-c", "command -v python3 || true; echo $VIRTUAL_ENV"], cwd=root,
                          env=reader_environ(), capture_output=True, text=True, check=True)
    assert os.path.realpath(os.path.join(sys.prefix, "bin")) not in done.stdout
