"""CLI tests: a clean patch state for every test, `cli(*argv) -> (exit code, stdout, stderr)`, and
`published(name)`: the published config.json of `name` (hf_configs/) as a checkpoint directory."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def clean(clean_patch_state):
    return clean_patch_state


@pytest.fixture
def cli_run(capsys):
    """Run `megatron-rl-patches *argv` in this process; returns (exit code, stdout, stderr)."""
    from megatron_rl_patches.apps.cli import main

    def run(*argv: str) -> tuple[int, str, str]:
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def published(tmp_path):
    """`published(name)`: a directory holding hf_configs/NAME.json as its config.json."""
    from kit.published_configs import published_checkpoint

    return lambda name: published_checkpoint(name, tmp_path)
