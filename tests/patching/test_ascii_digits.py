"""Whole numbers in settings and options are ASCII digits (issue 63 item 7): `str.isdigit()` takes '²'
(then `int()` raised a bare "invalid literal" naming neither the variable nor the entry) and `int()`
takes '٣' (read silently as 3), '３', '1_0' and '+2'. Each is refused by name in an OPD entry, a role,
top-k OPD's K and the CLI's counts; a launcher's rank variable in another script is rank 0."""
from __future__ import annotations

import pytest

from megatron_rl_patches.integrations.megatron.opd.opd_settings import opd_settings
from megatron_rl_patches.patching import env
from megatron_rl_patches.settings import launcher_rank

TEACHERS, ROLES = "MEGATRON_RL_PATCHES_OPD_TEACHERS", "MEGATRON_RL_PATCHES_INFERENCE_ROLES"
NOT_ASCII = ["²", "٣", "３", "1_0", "+2", "2.0", "𝟚"]


@pytest.mark.parametrize("size", ["tp", "pp"])
@pytest.mark.parametrize("written", NOT_ASCII)
def test_an_opd_entry_size_in_other_digits_is_refused_naming_the_variable_and_the_entry(written, size):
    entry = f"/a;{size}={written}"
    with pytest.raises(ValueError, match=rf"{TEACHERS} entry '/a;{size}=.*': option '{size}=.*' must be a "
                                         r"positive integer written in ASCII digits"):
        opd_settings({TEACHERS: entry})


@pytest.mark.parametrize("written", NOT_ASCII)
def test_a_role_size_in_other_digits_is_refused_naming_the_variable_and_the_role(written):
    with pytest.raises(ValueError, match=rf"{ROLES} role 'judge;tp=.*': option 'tp=.*' must be a positive "
                                         r"integer written in ASCII digits"):
        env.role_layouts({ROLES: f"judge;tp={written}"})


def test_ascii_sizes_still_read():
    assert env.role_layouts({ROLES: "judge; tp = 2 "}) == {"judge": 2}
    settings = opd_settings({TEACHERS: "/a;tp=2;pp=02"})
    assert settings is not None and (settings.teachers[0].tp, settings.teachers[0].pp) == (2, 2)


@pytest.mark.parametrize("written", NOT_ASCII)
def test_top_k_in_other_digits_is_refused_naming_the_variable(written):
    with pytest.raises(ValueError, match=r"MEGATRON_RL_PATCHES_OPD_K=.*: expected an integer k > 0"):
        opd_settings({TEACHERS: "/a", "MEGATRON_RL_PATCHES_OPD_K": written})


@pytest.mark.parametrize("written", [*NOT_ASCII, "-1", "x"])
def test_a_launcher_rank_in_other_digits_is_rank_zero(written):
    assert launcher_rank({"RANK": written}) == 0
    assert launcher_rank({"RANK": " 3 "}) == 3


@pytest.mark.parametrize("argv", [("memory", "7B", "--dp", "٣"), ("memory", "7B", "--dp", "²"),
                                  ("memory", "7B", "--tp", "٣")])
def test_cli_counts_in_other_digits_are_usage_errors(argv, capsys):
    from megatron_rl_patches.apps.cli import main

    assert main(list(argv)) == 2
    assert "invalid" in capsys.readouterr().err


def test_the_one_reader_takes_ascii_digits_only():
    from megatron_rl_patches.settings import ascii_int

    assert [ascii_int(text) for text in ("0", "7", "0012", "9" * 50)] == [0, 7, 12, int("9" * 50)]
    assert all(ascii_int(text) is None for text in [*NOT_ASCII, "", " 1", "-1", "9" * 5000])
