"""One verdict per variable and value (issue 110 item 7): every variable of the one table
(`settings.SETTINGS`) × odd values, read by the launcher (`run`'s child environment), the start-up hook
and `doctor`'s environment report: accepted by all three with one meaning (doctor's JSON shows the
table parser's; the hook applies the patches doctor lists), or refused by all three with the same words,
naming the variable. Before: doctor never read MEGATRON_RL_PATCHES_NATIVE ('2', '١' and 5,000 digits
passed it while the launcher and the hook refused them), and a selection or a DISABLE naming no patch
(' , ') was refused by the launcher alone.

The hook runs in this process on stand-in patches of the real patches' names (the selection is read
as on the real registry; nothing is wrapped): a real start-up is tests/patching/test_startup_messages.py's."""
from __future__ import annotations

import pytest

from megatron_rl_patches import settings
from megatron_rl_patches.apps.cli import doctor
from megatron_rl_patches.integrations import default_registry
from megatron_rl_patches.patching import env, records
from megatron_rl_patches.patching.registry import Registry
from megatron_rl_patches.patching.startup import hook
from megatron_rl_patches.patching.startup.launcher import launch_environment

VALUES = [None, "", "0", "1", "off", "yes", "on", "true", " 1 ", "2", "\u0661", "1" * 5000, "garbage", "all",
          "none", " , ", "ddp_hooks", " Torch", "\u200b"]
# doctor's JSON key of each variable whose meaning it shows
SHOWN = {env.SELECT: "selects", env.DISABLE: "disabled", env.STRICT: "strict", env.ALLOW_UNTESTED: "allow_untested",
         env.BACKEND: "backend", env.INVARIANT: "invariant", env.NATIVE: "native", env.VERL_ROWS: "verl_rows",
         env.SHARED_PREFIX: "shared_prefix", env.INFERENCE_ROLES: "inference_roles"}
TEACHERS = {settings.OPD_TEACHERS: "/ckpt/t"}  # beside top-k OPD's other variables: read only with teachers
# doctor checks these beyond their syntax (a teacher's files, its server): what is found there is no refusal
CHECKED_AT_LOAD = (settings.OPD_TEACHERS, settings.VERL_TEACHER)
NAMES = tuple(default_registry().patch_names())
BUILT: list[Registry] = []


def stand_ins() -> Registry:
    """A registry of the real patches' names whose targets no process imports (the hook's factory)."""
    BUILT.append(Registry([records.Patch(name, "megatron_rl_patches_stand_in_target:f", lambda *_: None, "stand-in",
                                         requires=None) for name in NAMES]))
    return BUILT[-1]


def _environment(variable: str, value: str | None) -> dict[str, str]:
    background = {} if variable == env.SELECT else {env.SELECT: "all"}
    if variable in settings.OPD_VARIABLES and variable != settings.OPD_TEACHERS:
        background.update(TEACHERS)
    return {**background, **({} if value is None else {variable: value})}


def _launcher(environ):
    try:
        launch_environment(None, environ)
    except ValueError as exc:
        return str(exc)
    return None


def _hook(environ, capsys):
    """The lines start-up says, and the patches it applies."""
    hook.start(environ, f"{__name__}:stand_ins")
    applied = sorted(s.name for s in BUILT[-1].applied() if s.status == "pending") if BUILT else []
    for registry in BUILT:
        registry.reset()
    BUILT.clear()
    return capsys.readouterr().err.splitlines(), applied


def _doctor(environ, monkeypatch):
    for name in [name for name in settings.VARIABLES if name not in environ]:
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    return doctor.environment_report()


def _meaning(variable, value):
    """The table parser's meaning, as doctor's JSON shows it."""
    meaning = settings.SETTINGS[variable].parse(value)  # type: ignore[operator]
    if variable == env.BACKEND and meaning == settings.AUTO:
        return None  # doctor's JSON: null where each op chooses
    if variable == env.INFERENCE_ROLES and meaning is None:
        return ["prm_teacher", "teacher"]  # unset: slime's default roles (doctor shows them)
    return list(meaning) if isinstance(meaning, tuple) else meaning


@pytest.mark.parametrize("variable", settings.VARIABLES)
def test_one_verdict_whoever_reads(variable, capsys, clean_patch_state):
    refused = 0
    for value in VALUES:
        environ = _environment(variable, value)
        case = f"{variable}={value if value is None else value[:20]!r}"
        refusal = _launcher(environ)
        lines, applied = _hook(environ, capsys)
        environment, problems = _doctor(environ, clean_patch_state)
        if variable == env.SELECT and not env.is_enabled(environ):  # off: the hook and doctor read nothing more
            assert lines == [] and applied == [] and not environment["enabled_at_startup"], case
            assert not [problem for problem in problems if env.SELECT in problem], case
            # the launcher's own rule: it selects every patch when the variable is unset, refuses it off
            assert refusal is None if not (value or "").strip() else "disables patching" in refusal, case
            continue
        if refusal is not None:
            refused += 1
            assert variable in refusal, case
            assert [line for line in lines if refusal in line] == lines and len(lines) == 1, (case, refusal, lines)
            assert refusal in problems, (case, refusal, problems)
            continue
        assert lines == [], (case, lines)
        assert applied == sorted(environment["resolved"]), case
        assert environment["refusals"] == {} and environment["error"] is None, case
        if variable in SHOWN:
            assert environment[SHOWN[variable]] == _meaning(variable, value), case
        elif variable not in CHECKED_AT_LOAD:
            assert not [problem for problem in problems if variable in problem and "/ckpt/t" not in problem], case
    assert refused or variable in (settings.TEACHER_API_KEY, settings.OPD_TEACHERS)  # every other one refuses some


def test_the_cases_that_disagreed_before():
    """Issue 110 item 7's cases, each refused naming the variable (doctor passed the first three)."""
    for value in ("2", "\u0661", "1" * 5000):
        assert env.NATIVE in env.summary({env.NATIVE: value})["refusals"]
    for variable in (env.SELECT, env.DISABLE):
        assert variable in env.summary({env.SELECT: "all", variable: " , "})["refusals"]
