"""Bad options name themselves (issue 29's new user's trips): a seed out of range is a one-line
usage error, `run --patches` names the option at fault rather than the variable."""
from __future__ import annotations

import pytest

from megatron_rl_patches.apps import cli
from megatron_rl_patches.patching import env


@pytest.mark.parametrize("seed", ["18446744073709551616", "-1", str(2**32)])
def test_a_seed_out_of_range_is_a_one_line_usage_error(cli_run, seed):
    code, out, err = cli_run("demo", "--seed", seed, "--route", "plain", "--rollouts", "1", "--steps", "1")
    assert code == cli.USAGE and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("megatron-rl-patches demo: ") and "--seed" in line and "2**32" in line


def test_run_with_a_bad_patches_option_names_the_option_not_the_variable(cli_run, monkeypatch):
    monkeypatch.delenv(env.SELECT, raising=False)
    code, out, err = cli_run("run", "--patches", "bogus", "--", "true")
    assert code == cli.USAGE and out == ""
    (line,) = err.strip().splitlines()
    assert "unknown patch name(s) 'bogus' in --patches" in line and env.SELECT + ";" not in line
