"""`doctor`'s summary first (issue 72 item 10f): what applies at start-up, what is off here, the
problems found, before the ~50 target lines; and no line saying patches apply at start-up beside the
problem saying nothing applies without code (a selection without a start-up file)."""
from __future__ import annotations

import json

import pytest

from megatron_rl_patches.patching.startup import files as startup


@pytest.fixture
def site(clean, tmp_path):
    """This interpreter's site directories: one empty folder (a start-up file goes there)."""
    clean.setattr(startup, "site_dirs", lambda: [str(tmp_path)])
    return tmp_path


def _summary(out: str) -> list[str]:
    lines = out.splitlines()
    assert lines[0] == "summary:", lines[:3]
    end = lines.index(next(line for line in lines if line.startswith("python ")))
    return lines[1:end]


def test_the_summary_comes_first_and_says_what_applies_what_is_off_and_the_problems(cli_run, site):
    code, out, _ = cli_run("doctor")
    summary = _summary(out)
    assert code == 0 and len(summary) <= 6, summary
    text = "\n".join(summary)
    assert "applies at start-up: nothing (MEGATRON_RL_PATCHES is unset" in text, text
    assert "ddp_hooks" in text and "slime" in text  # a patch whose targets are here; a framework that is not
    assert summary[-1] == "  problems found: none"
    assert out.index("summary:") < out.index("patches (status, target") < out.index("no problems found")


def test_a_selection_without_a_start_up_file_is_not_said_to_apply(cli_run, site, clean):
    clean.setenv("MEGATRON_RL_PATCHES", "ddp_hooks,grad_windows")
    code, out, _ = cli_run("doctor")
    text = "\n".join(_summary(out))
    assert code == 1
    assert "applies at start-up: nothing: MEGATRON_RL_PATCHES selects 2 patches, but this interpreter has no " \
           "start-up file" in text, text
    assert "problems found: 1 (listed at the end)" in text
    assert "start-up applies" not in out  # it read as "they apply" beside "nothing applies without code"
    assert "  selected for start-up: ddp_hooks, grad_windows (not applied here: no start-up file; see the " \
           "problems below)" in out
    assert "so nothing applies without code" in out.split("problems:")[-1]


def test_with_a_start_up_file_the_selection_applies(cli_run, site, clean):
    clean.setenv("MEGATRON_RL_PATCHES", "ddp_hooks,grad_windows")
    startup.install(str(site))
    code, out, _ = cli_run("doctor")
    assert code == 0, out
    assert "  applies at start-up: ddp_hooks, grad_windows" in _summary(out)
    assert "  selected for start-up: ddp_hooks, grad_windows\n" in out


def test_the_json_report_carries_the_summary(cli_run, site, clean):
    clean.setenv("MEGATRON_RL_PATCHES", "ddp_hooks")
    code, out, _ = cli_run("doctor", "--json")
    summary = json.loads(out)["summary"]
    assert code == 1 and summary["applies_at_startup"] == [] and summary["problems"] == 1
    assert "ddp_hooks" in summary["every_target_here"] and "slime_opd" in summary["no_target_here"]
    # "slime", or a module of it where a stand-in package named slime is importable (the test kit's)
    assert any(name.split(".")[0] == "slime" for name in summary["not_installed"]), summary["not_installed"]


def test_under_the_launcher_the_selection_applies_without_a_start_up_file(cli_run, site, clean):
    """`megatron-rl-patches run -- ... doctor`: the launcher's hook ran in this process (and runs in
    every process it starts), so the selection applies and no problem says nothing does."""
    from megatron_rl_patches.patching.startup import hook

    clean.setenv("MEGATRON_RL_PATCHES", "ddp_hooks")
    clean.setattr(hook, "has_run", lambda: True)
    code, out, _ = cli_run("doctor")
    assert code == 0, out
    assert "  applies at start-up: ddp_hooks" in _summary(out) and "nothing applies without code" not in out
