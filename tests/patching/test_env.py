"""Environment variables -> selection, precedence against apply() arguments, and what start-up does
with them (unknown names: one stderr line, exit 0; strict: the error surfaces at import)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from megatron_rl_patches.integrations import default_registry
from megatron_rl_patches.patching import env, registry

REG = default_registry()  # the real catalog

KNOWN = ("ddp_hooks", "train_reentry", "inference_roles", "slime_logprobs")
VARS = (env.SELECT, env.DISABLE, env.STRICT, env.INFERENCE_ROLES)


@pytest.fixture
def clean_registry(clean_patch_state):
    return clean_patch_state


def child_env(**variables: str) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_RL_PATCHES")}
    environ.update(variables)
    return environ


@pytest.mark.parametrize("value", [None, "", "0", " 0 ", "false", "off", "none", "No"])
def test_off_values_disable_startup(value):
    environ = {} if value is None else {env.SELECT: value}
    assert not env.is_enabled(environ)
    assert env.selected_names(environ) is None


@pytest.mark.parametrize("value", ["1", "all", "ALL", " all ", "true", "on"])
def test_all_values_select_every_patch(value):
    environ = {env.SELECT: value}
    assert env.is_enabled(environ)
    assert env.selected_names(environ) is None
    assert env.resolve_selection(KNOWN, environ=environ) == list(KNOWN)


def test_names_are_split_trimmed_and_kept_in_catalog_order():
    environ = {env.SELECT: " slime_logprobs ,, ddp_hooks ,"}
    assert env.selected_names(environ) == ["slime_logprobs", "ddp_hooks"]
    assert env.resolve_selection(KNOWN, environ=environ) == ["ddp_hooks", "slime_logprobs"]


def test_unknown_names_raise_listing_the_valid_ones():
    with pytest.raises(ValueError) as info:
        env.resolve_selection(KNOWN, environ={env.SELECT: "ddp_hooks,ddp_hook"})
    message = str(info.value)
    assert "'ddp_hook'" in message and env.SELECT in message
    assert all(name in message for name in KNOWN)
    with pytest.raises(ValueError, match=env.DISABLE):
        env.resolve_selection(KNOWN, environ={env.SELECT: "all", env.DISABLE: "nope"})
    with pytest.raises(ValueError, match="only="):
        env.resolve_selection(KNOWN, only=["nope"], environ={})
    with pytest.raises(ValueError, match="exclude="):
        env.resolve_selection(KNOWN, exclude="nope", environ={})
    with pytest.raises(TypeError, match="strings"):
        env.resolve_selection(KNOWN, only=[1], environ={})


def test_disable_removes_names_from_env_selection_and_from_all():
    environ = {env.SELECT: "ddp_hooks,train_reentry", env.DISABLE: "train_reentry"}
    assert env.resolve_selection(KNOWN, environ=environ) == ["ddp_hooks"]
    environ = {env.SELECT: "1", env.DISABLE: "ddp_hooks, slime_logprobs"}
    assert env.resolve_selection(KNOWN, environ=environ) == ["train_reentry", "inference_roles"]
    # apply() with no arguments and the variable off means every patch, less DISABLE
    assert env.resolve_selection(KNOWN, environ={env.DISABLE: "ddp_hooks"}) == list(KNOWN[1:])


def test_explicit_arguments_beat_the_environment():
    environ = {env.SELECT: "ddp_hooks", env.DISABLE: "train_reentry,bogus_typo"}
    # only= ignores the variables entirely (a typo there cannot break explicit code)
    assert env.resolve_selection(KNOWN, only="train_reentry", environ=environ) == ["train_reentry"]
    assert env.resolve_selection(KNOWN, only=[], environ=environ) == []
    # exclude= always drops
    environ = {env.SELECT: "ddp_hooks,train_reentry"}
    assert env.resolve_selection(KNOWN, exclude=["ddp_hooks"], environ=environ) == ["train_reentry"]
    assert env.resolve_selection(KNOWN, only="ddp_hooks,train_reentry", exclude="ddp_hooks", environ={}) == [
        "train_reentry"
    ]


def test_selection_gives_each_name_one_fate_with_its_reason():
    environ = {env.SELECT: "ddp_hooks,train_reentry,inference_roles", env.DISABLE: "train_reentry,ddp_hooks"}
    assert env.selection(KNOWN, exclude="ddp_hooks", environ=environ) == {
        "ddp_hooks": "disabled by exclude=",  # exclude= named first, though DISABLE lists it too
        "train_reentry": f"disabled by {env.DISABLE}",
        "inference_roles": None,  # selected
        "slime_logprobs": "",  # nothing asked for it: nothing to explain
    }
    assert env.selection(KNOWN, only="train_reentry", environ=environ) == {
        "ddp_hooks": "", "train_reentry": None, "inference_roles": "", "slime_logprobs": ""}


@pytest.mark.parametrize(("value", "strict"), [(None, False), ("", False), ("0", False), ("1", True), ("true", True)])
def test_strict_variable(value, strict):
    assert env.is_strict({} if value is None else {env.STRICT: value}) is strict


def test_role_names_unset_empty_and_list():
    assert env.role_names({}) is None  # the framework's default roles (slime's: tests/integrations)
    assert env.role_names({env.INFERENCE_ROLES: ""}) == []
    assert env.role_names({env.INFERENCE_ROLES: "ref, teacher"}) == ["ref", "teacher"]


@pytest.mark.parametrize("value", ["teacher:swap,teacher:stream", "teacher,teacher:stream", "teacher, teacher"])
def test_a_role_listed_twice_is_refused_naming_the_variable(value):
    """issue 38: the last entry silently won."""
    with pytest.raises(ValueError, match=f"{env.INFERENCE_ROLES}=.*lists role 'teacher' more than once"):
        env.checked_role_names({env.INFERENCE_ROLES: value})
    assert "more than once" in env.summary({env.INFERENCE_ROLES: value})["errors"][0]
    roles = env.checked_role_names({env.INFERENCE_ROLES: "teacher:swap,prm_teacher:stream"})
    assert roles == ["teacher", "prm_teacher"]


def test_summary_reports_raw_and_parsed_values():
    summary = env.summary({env.SELECT: "ddp_hooks", env.STRICT: "1"})
    assert summary["variables"][env.SELECT] == "ddp_hooks"
    assert summary["variables"][env.DISABLE] is None
    assert summary["enabled_at_startup"] and summary["strict"]
    assert summary["selects"] == ["ddp_hooks"]
    assert env.summary({})["selects"] is None
    assert env.summary({env.SELECT: "all"})["selects"] == "all"


def by_name(statuses):
    out: dict[str, set[str]] = {}
    for status in statuses:
        out.setdefault(status.name, set()).add(status.status)
    return out


def test_apply_follows_env_and_explicit_arguments_win(clean_registry, monkeypatch):
    monkeypatch.setenv(env.SELECT, "slime_logprobs")
    chosen = REG.apply()
    assert {s.name for s in chosen} == {"slime_logprobs"}
    REG.revert()

    monkeypatch.setenv(env.DISABLE, "slime_logprobs")
    monkeypatch.setenv(env.SELECT, "all")
    REG.apply()
    states = {(s.name, s.reason) for s in REG.applied() if s.name == "slime_logprobs"}
    assert states == {("slime_logprobs", f"disabled by {env.DISABLE}")}
    REG.revert()

    chosen = REG.apply(only="slime_logprobs")  # explicit beats DISABLE and SELECT
    assert {s.name for s in chosen} == {"slime_logprobs"}
    assert by_name(REG.applied())["ddp_hooks"] == {"skipped"}


def test_apply_with_unknown_names_changes_nothing(clean_registry, monkeypatch):
    before = [s.as_dict() for s in REG.applied()]
    with pytest.raises(ValueError, match="valid names: ddp_hooks, train_reentry"):
        REG.apply(only="ddp_hooks,bogus")
    monkeypatch.setenv(env.SELECT, "bogus")
    with pytest.raises(ValueError, match="'bogus' in MEGATRON_RL_PATCHES"):
        REG.apply()
    assert [s.as_dict() for s in REG.applied()] == before


def test_strict_variable_is_the_default_and_the_argument_wins(clean_registry, monkeypatch):
    # a record whose target attribute does not exist: warn + skipped, or raise when strict
    patch = registry.Patch("ghost", "json:no_such_function", lambda *a: None, "test", requires=None)
    reg = registry.Registry([patch])
    monkeypatch.setenv(env.STRICT, "1")
    with pytest.raises(registry.PatchTargetMissing, match="json:no_such_function"):
        reg.apply(only="ghost")
    statuses = reg.apply(only="ghost", strict=False)
    assert statuses[0].status == "skipped" and "no_such_function" in statuses[0].reason
    monkeypatch.delenv(env.STRICT)
    assert reg.apply(only="ghost")[0].status == "skipped"


STARTUP_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import megatron_rl_patches.patching.startup.hook as bootstrap
    bootstrap.run(); bootstrap.run()  # a venv executes the .pth twice
    result = {"ran": bootstrap.has_run()}
    try:
        import slime.backends.megatron_utils.model
        result["import"] = "ok"
    except BaseException as exc:
        result["import"] = f"{type(exc).__name__}: {exc}"
    import json as _json_is_not_a_target  # noqa: F401
    print(json.dumps(result))
    """
)


def run_startup(root, **variables):
    environ = child_env(**variables)
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), environ.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", STARTUP_SCRIPT], env=environ, capture_output=True, text=True,
                          timeout=120)
    return proc, json.loads(proc.stdout.strip().splitlines()[-1])


def test_startup_unknown_name_one_stderr_line_and_exit_0(slime_standin):
    proc, result = run_startup(slime_standin, MEGATRON_RL_PATCHES="ddp_hooks,bogus")
    assert proc.returncode == 0
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("megatron-rl-patches:") and "'bogus'" in lines[0] and "ddp_hooks" in lines[0]
    assert result == {"ran": True, "import": "ok"}  # not strict: nothing raises later either


def test_startup_strict_unknown_name_raises_at_first_import_of_a_target(slime_standin):
    proc, result = run_startup(slime_standin, MEGATRON_RL_PATCHES="bogus", MEGATRON_RL_PATCHES_STRICT="1")
    assert proc.returncode == 0
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert result["import"].startswith("ValueError: ") and "'bogus'" in result["import"]
    assert env.STRICT in result["import"]


def test_launcher_rank_reads_the_usual_variables():
    from megatron_rl_patches.settings import launcher_rank

    assert launcher_rank({}) == 0
    assert launcher_rank({"RANK": "3"}) == 3
    assert launcher_rank({"SLURM_PROCID": "2"}) == 2
    assert launcher_rank({"RANK": "garbage"}) == 0


def test_start_up_messages_come_from_rank_zero_only():
    quiet = subprocess.run(
        [sys.executable, "-c", "import megatron_rl_patches.patching.startup.hook as b; b.run()"],
        env=child_env(MEGATRON_RL_PATCHES="bogus", RANK="1"), capture_output=True, text=True, timeout=60,
    )
    loud = subprocess.run(
        [sys.executable, "-c", "import megatron_rl_patches.patching.startup.hook as b; b.run()"],
        env=child_env(MEGATRON_RL_PATCHES="bogus", RANK="0"), capture_output=True, text=True, timeout=60,
    )
    assert quiet.returncode == loud.returncode == 0
    assert quiet.stderr == ""
    assert loud.stderr.count("\n") == 1 and "bogus" in loud.stderr


def test_a_left_over_start_up_line_is_silent_without_the_package(tmp_path):
    """An editable install removed after `startup install` leaves the .pth behind: no traceback."""
    from megatron_rl_patches.patching.startup import files as startup

    line = startup.CONTENTS[startup.PTH_NAME]
    proc = subprocess.run(
        [sys.executable, "-S", "-c", f"exec({line!r})"], cwd=tmp_path,
        env={"PATH": os.environ.get("PATH", "")}, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0 and proc.stderr == ""
