"""--help describes every environment variable: the backend's meaning and slime's default roles."""
from __future__ import annotations

from megatron_rl_patches.integrations.slime.roles import DEFAULT_INFERENCE_ROLES
from megatron_rl_patches.patching import env


def _variable_help(text: str) -> dict[str, str]:
    """The epilog's variables -> their description, joined into one line each."""
    described: dict[str, list[str]] = {}
    current = None
    for line in text.split("environment variables:")[1].split("exit codes:")[0].splitlines():
        if line.startswith("  ") and not line.startswith("    "):
            current = line.strip()
            described[current] = []
        elif current and line.strip():
            described[current].append(line.strip())
    return {name: " ".join(words) for name, words in described.items()}


def test_help_describes_every_variable_the_backend_and_the_default_roles(cli_run):
    code, out, _ = cli_run("--help")
    assert code == 0
    described = _variable_help(out)
    from megatron_rl_patches.integrations.megatron.opd import opd_settings
    from megatron_rl_patches.settings import VERL_ROWS as ROWS_ENV

    opd = {value for name, value in vars(opd_settings).items()
           if name.isupper() and isinstance(value, str) and value.startswith(opd_settings.PREFIX)
           and value != opd_settings.PREFIX}
    assert opd | {ROWS_ENV} <= set(env.VARIABLES)
    assert set(described) == set(env.VARIABLES)
    assert "role:mode" in described[env.INFERENCE_ROLES] and "each once" in described[env.INFERENCE_ROLES]
    assert all(described.values()), [name for name, text in described.items() if not text]
    backend = described[env.BACKEND]
    assert all(word in backend for word in ("torch", "triton", "auto", "backend="))
    roles = described[env.INFERENCE_ROLES]
    assert all(role in roles for role in DEFAULT_INFERENCE_ROLES), roles
    assert "Hugging Face directory" in described["MEGATRON_RL_PATCHES_OPD_TEACHERS"]  # issue 49: it was omitted


def test_the_misspelling_check_knows_every_variable_help_describes():
    """A variable --help documents is never called unknown (and the launcher's own one neither)."""
    from megatron_rl_patches.integrations import check_settings, variable_names

    assert set(variable_names()) == set(env.VARIABLES) | {env.LAUNCHER_ROOT}
    check_settings({name: "" for name in variable_names() if "OPD" not in name})


def test_help_and_run_help_give_the_teacher_entry_options(cli_run):
    """The OPD teachers' entry options, as opd_settings parses them, in --help and run --help."""
    from megatron_rl_patches.integrations.megatron.opd import opd_settings

    for argv in (("--help",), ("run", "--help")):
        code, out, _ = cli_run(*argv)
        assert code == 0, argv
        teachers = _variable_help(out)[opd_settings.TEACHERS]
        assert f"PATH;{opd_settings.OWN_TOKENIZER}" in teachers, (argv, teachers)
        assert f";{opd_settings.STOP_TOKENS}module:function" in teachers, (argv, teachers)
        assert "PATH;tp=N" in teachers and "PATH;pp=N" in teachers, (argv, teachers)  # issue 63 item 9
