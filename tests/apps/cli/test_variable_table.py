"""One table of variables (megatron_rl_patches/settings.py): every MEGATRON_RL_PATCHES* name the
package, the docs, the README and --help write is one the misspelling check knows, --help describes
and `doctor` shows; the invariant switch (issue 63 item 1: documented, yet unknown to the check) is
taken by `run`, `doctor` and the start-up hook, and its value checked before the child starts."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import megatron_rl_patches
from megatron_rl_patches.integrations import check_settings, variable_names
from megatron_rl_patches.patching import env
from megatron_rl_patches.patching.startup.launcher import launch_environment

REPO = Path(megatron_rl_patches.__file__).resolve().parent.parent
NAME = re.compile(r"MEGATRON_RL_PATCH\w*")
INVARIANT = "MEGATRON_RL_PATCHES_INVARIANT"
# Names docs/patching.md writes as examples of misspellings the check refuses (a test below holds them refused).
MISSPELLINGS = {"MEGATRON_RL_PATCH", "MEGATRON_RL_PATCHES_DISABLED", "MEGATRON_RL_PATCHES_OPD_TEACHER"}
OPD_FAMILY = "MEGATRON_RL_PATCHES_OPD_"  # "the MEGATRON_RL_PATCHES_OPD_* variables"


def written_names(text: str) -> set[str]:
    return {name for name in NAME.findall(text) if name != OPD_FAMILY}


def texts() -> dict[str, str]:
    """Where a user reads variable names: the docs, the README, the package's sources (messages)."""
    files = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md",
             *sorted((REPO / "megatron_rl_patches").rglob("*.py"))]
    return {str(path.relative_to(REPO)): path.read_text(encoding="utf-8") for path in files}


def test_every_variable_the_docs_the_readme_and_the_sources_name_is_known():
    known = set(variable_names())
    unknown = {where: sorted(written_names(text) - known - MISSPELLINGS) for where, text in texts().items()}
    assert not {where: names for where, names in unknown.items() if names}
    assert INVARIANT in known


@pytest.mark.parametrize("argv", [("--help",), ("run", "--help"), ("doctor", "--help"), ("list", "--help")])
def test_every_variable_help_names_is_known_and_help_lists_every_one(cli_run, argv):
    code, out, _ = cli_run(*argv)
    assert code == 0
    known = set(variable_names()) - {env.LAUNCHER_ROOT}  # the launcher's own: set by `run`, never by hand
    assert written_names(out) == known  # each one described, none unknown
    assert INVARIANT in out


def test_the_documented_misspellings_are_refused_with_the_close_name():
    for name in MISSPELLINGS:
        with pytest.raises(ValueError, match="did you mean"):
            check_settings({name: "1"})


@pytest.mark.parametrize("value", ["1", "0", "true", "OFF", " yes ", ""])
def test_the_invariant_switch_is_known_to_the_check_and_the_launcher(value):
    check_settings({INVARIANT: value})
    child = launch_environment(None, {INVARIANT: value})
    assert child[INVARIANT] == value


@pytest.mark.parametrize("value", ["tru", "2", "invariant"])
def test_a_bad_invariant_value_is_refused_by_the_launcher_before_anything_starts(value):
    with pytest.raises(ValueError, match=rf"{INVARIANT}='{value}' is not a switch"):
        launch_environment(None, {INVARIANT: value})


def test_doctor_shows_the_switch_and_finds_no_problem_in_it(cli_run, monkeypatch):
    monkeypatch.setenv(INVARIANT, "1")
    code, out, _ = cli_run("doctor")
    assert f"{INVARIANT}=1" in out
    assert INVARIANT not in out.split("problems:")[-1] if "problems:" in out else True
    monkeypatch.setenv(INVARIANT, "tru")
    code, out, _ = cli_run("doctor")
    assert code == 1 and f"{INVARIANT}='tru' is not a switch" in out.split("problems:")[-1]


def test_the_summary_reads_the_switch():
    assert env.summary({INVARIANT: "on"})["invariant"] is True
    assert env.summary({})["invariant"] is None
    summary = env.summary({INVARIANT: "tru"})
    assert summary["invariant"] is None and any(INVARIANT in error for error in summary["errors"])


def variable_table_names() -> set[str]:
    """The names docs/variables.md's table describes (the README's until it became a first page,
    issue 122): each row's first cell (`..._OPD_*`: the family, every MEGATRON_RL_PATCHES_OPD_ name)."""
    text = (REPO / "docs" / "variables.md").read_text(encoding="utf-8")
    table = text[text.index("| variable | meaning |"):].split("\n\n", 1)[0]
    rows = [line.split("|")[1] for line in table.splitlines()[2:] if line.startswith("|")]
    return {name for cell in rows for name in NAME.findall(cell)}


def test_every_variable_the_package_reads_is_in_the_variable_table():
    """Issue 72 item 10c: the package's table of what it reads (every reading module takes its name
    from there) and every name a source writes (what a grep of the package finds), less the
    launcher's own (`run` sets it for its children), each a row of docs/variables.md's table."""
    written = {name for where, text in texts().items() if where.startswith("megatron_rl_patches")
               for name in written_names(text)}
    read = (set(variable_names()) | written) - MISSPELLINGS - {env.LAUNCHER_ROOT}  # the prefix: the check's
    described = variable_table_names()
    missing = sorted(name for name in read
                     if name not in described and not (name.startswith(OPD_FAMILY) and OPD_FAMILY in described))
    assert not missing, f"read by the package, missing from docs/variables.md's table: {missing}"
    assert env.LAUNCHER_ROOT in written  # the grep sees the start-up shim's literal read
