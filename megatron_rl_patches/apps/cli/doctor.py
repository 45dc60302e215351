"""`megatron-rl-patches doctor`: the megatron-core in use (where from, version, tested or not), per
patch its supported range / tested label / status, the environment and the start-up files."""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
from typing import Any

import megatron_rl_patches
from megatron_rl_patches import settings
from megatron_rl_patches.apps.cli._common import OK, PROBLEM, PROG
from megatron_rl_patches.apps.cli.doctor_shared_prefix import (
    door_verdicts,
    shared_prefix_problems,
    shared_prefix_statement,
)
from megatron_rl_patches.apps.cli.doctor_summary import summary_lines, summary_of
from megatron_rl_patches.apps.cli.doctor_verl import verl_teacher_report
from megatron_rl_patches.apps.cli.targets import STATUS_HELP, find_module, shown_status
from megatron_rl_patches.inference.loading.json_read import parsed_json
from megatron_rl_patches.integrations import default_registry
from megatron_rl_patches.integrations.megatron import version as megatron_version
from megatron_rl_patches.integrations.megatron.opd.opd_settings import opd_settings
from megatron_rl_patches.integrations.slime.roles import DEFAULT_INFERENCE_ROLES
from megatron_rl_patches.patching import check_settings, env, registry
from megatron_rl_patches.patching.startup import files as startup_files
from megatron_rl_patches.patching.startup import hook
from megatron_rl_patches.settings import OPD_PREFIX, TEACHER_API_KEY, VERL_TEACHER
from megatron_rl_patches.teachers.kinds import RunFacts, entry_report
from megatron_rl_patches.teachers.redaction import redacted, refuse_userinfo, scrubbed_all

# Installed distributions `doctor` reports. megatron-core, an optional extra, also gets its own
# section: the code in use may be a source checkout with no distribution.
DISTRIBUTIONS = ("torch", "megatron-core", "wrapt", "packaging", "megatron-rl-patches")
REQUIRED = ("torch", "wrapt", "packaging")
_SHOWN_VALUE = 120  # characters of an environment variable's value shown in the text report
# the variables holding comma-separated names: shown cut between names, never inside one
LISTS = ("MEGATRON_RL_PATCHES", "MEGATRON_RL_PATCHES_DISABLE", "MEGATRON_RL_PATCHES_INFERENCE_ROLES")
KEY_SET = "(set, not shown)"  # what the report shows of a served teacher's API key


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = f"{parser.description}\n\n{STATUS_HELP}\nExit code 1 when a problem is found."
    parser.add_argument("--json", action="store_true", help="print a JSON object")


def _editable_install() -> bool | None:
    """Whether megatron-rl-patches is installed in editable mode (None: not installed)."""
    # A source checkout's *.egg-info on sys.path is listed too: the installer's record decides.
    dists = list(importlib.metadata.distributions(name="megatron-rl-patches"))
    for dist in dists:
        text = dist.read_text("direct_url.json")
        if text:
            try:
                return bool(parsed_json(text, ValueError).get("dir_info", {}).get("editable", False))
            except (ValueError, AttributeError):  # the installer's record is damaged: not known
                return None
    return False if dists else None


def megatron_section() -> tuple[dict[str, Any], list[str]]:
    """Where megatron-core comes from, its version and whether a test lane ran it; problems."""
    info = megatron_version.megatron_info()
    label = megatron_version.tested_label(info.version)
    section = {
        "version": info.version,
        "origin": info.origin,
        "location": info.location,
        "supported": megatron_version.SUPPORTED,
        "tested": label,
        "tested_versions": dict(megatron_version.TESTED),
    }
    problems = []
    if info.origin is None:
        problems.append(
            "megatron-core not found (no installed distribution, no source checkout on sys.path): install "
            "megatron-rl-patches[megatron] or put a Megatron-LM checkout on PYTHONPATH"
        )
    elif info.version is None:
        problems.append(f"cannot read the megatron-core version of {info.location} (package_info.py)")
    return section, problems  # out of range: each guarded patch reports it


def target_rows() -> tuple[list[dict[str, Any]], list[str]]:
    """Per (patch, target): module found, supported range, tested label, status; and problems."""
    problems: list[str] = []
    modules: dict[str, tuple[bool, str | None]] = {}
    rows = []
    for patch, status in default_registry().entries():
        if patch.module not in modules:
            modules[patch.module] = find_module(patch.module)
        found, why = modules[patch.module]
        version = registry.patch_version(patch)
        guarded = bool(patch.requires and patch.versions)
        problem = registry.version_problem(patch) if guarded else None
        native = registry.native_version(patch) is not None
        if problem and found and not native:
            problems.append(f"'{patch.name}': {problem}")
        tested = None
        if guarded and patch.requires == megatron_version.DISTRIBUTION:
            tested = megatron_version.tested_label(version, patch.versions)
        rows.append(
            {
                "name": patch.name,
                "target": patch.target,
                "module_found": found,
                "module_problem": why,
                "requires": patch.requires,
                "versions": patch.versions,
                "installed": version,
                "in_range": None if version is None or not patch.versions else problem is None,
                "tested": tested,
                "native": native,
                "status": status.status,
                "code": status.code,
                "reason": status.reason,
                "shown": shown_status(status),
            }
        )
    return rows, list(dict.fromkeys(problems))


def _startup_section(environment: dict[str, Any]) -> tuple[dict[str, Any], bool | None, list[str]]:
    problems = []
    found = [f for d in startup_files.site_dirs() for f in startup_files.inspect_dir(d) if f.present]
    pth_installed = any(f.ours and f.path.endswith(startup_files.PTH_NAME) for f in found)
    problems += [f"{f.path} exists but is not megatron-rl-patches' start-up file" for f in found if not f.ours]
    editable = _editable_install()
    if environment["enabled_at_startup"] and not pth_installed and not hook.has_run():  # ran: the launcher's
        problems.append(
            f"{env.SELECT} is set but no start-up file is installed in this interpreter's site "
            f"directories, so nothing applies without code"
            + (" (editable installs do not get it from pip)" if editable else "")
            + f"; start the job with the launcher `{PROG} run -- COMMAND ...` (any install, writes "
            f"nothing), or run `{PROG} startup install` once to add the start-up file here"
        )
    section = {
        "pth_installed": pth_installed,
        "files": [f.as_dict() for f in found],
        "site_dirs": startup_files.site_dirs(),
        "bootstrap_ran": hook.has_run(),
    }
    return section, editable, problems


def environment_report() -> tuple[dict[str, Any], list[str]]:
    """The environment as `doctor` reads it (every variable through its parser, `env.summary`; the
    frameworks' checks; the teachers' files and servers; what the selection leaves out), and its problems."""
    environment: dict[str, Any] = env.summary()
    if environment["inference_roles"] is None:  # unset: slime's default roles; wrong: none (in the problems)
        unset = environment["variables"][env.INFERENCE_ROLES] is None
        environment["inference_roles"] = list(DEFAULT_INFERENCE_ROLES) if unset else []
    problems = list(environment["errors"])
    # a user or password in a URL (refused by the settings' checks) is never printed: every value
    # goes through the one redaction, whichever variable holds a URL (or was given one by mistake)
    environment["variables"] = {name: value if value is None else redacted(value)
                                for name, value in environment["variables"].items()}
    environment["opd"] = {name: redacted(value) for name, value in sorted(os.environ.items())
                          if name.startswith(OPD_PREFIX)}
    if environment["variables"].get(TEACHER_API_KEY):  # a secret: whether it is set, never its value
        environment["variables"][TEACHER_API_KEY] = KEY_SET
    environment["teachers_checked"] = []
    try:
        check_settings()  # the frameworks' own variables, as `run` and slime_opd check them (a served teacher's ids)
    except ValueError as exc:
        problems.append(str(exc))
    try:  # the teachers' files and servers, also where check_settings refused a setting they do not depend on
        found, environment["teachers_checked"] = teacher_report()
        problems += found
    except ValueError as exc:  # the settings unreadable: check_settings' refusal again (listed once)
        problems.append(str(exc))
    except OSError as exc:  # a path the system cannot look at (a name past its limit): said, never a crash
        problems.append(f"{OPD_PREFIX}TEACHERS: a teacher's path cannot be looked at on this machine "
                        f"({type(exc).__name__}: {exc.strerror or exc}); fix the path (the training actors read it)")
    try:  # verl's served teacher: its URL's user refused, then its servers asked as slime's (each replica)
        refuse_userinfo(os.environ.get(VERL_TEACHER, ""), VERL_TEACHER)
        found, checked = verl_teacher_report()
        problems += found
        environment["teachers_checked"] += checked
    except ValueError as exc:
        problems.append(str(exc))
    try:
        names = default_registry().patch_names()
        environment["resolved"] = env.resolve_selection(names) if environment["enabled_at_startup"] else []
        environment["error"] = None
        fates = env.selection(names) if environment["enabled_at_startup"] else {}
        problems += opd_selection_problems(environment, fates)
        if environment.get("shared_prefix"):
            environment["shared_prefix_doors"] = door_verdicts(environment, fates, not_selected)
        problems += shared_prefix_problems(environment, _shown_setting)
    except ValueError as exc:
        environment["resolved"], environment["error"] = None, str(exc)
        problems.append(str(exc))
    return environment, problems


def not_selected(environment: dict[str, Any], patch: str, fates: dict[str, str | None]) -> tuple[str, str] | None:
    """Why `patch` will not apply at start-up, and what to do, from the variables that decide it
    (MEGATRON_RL_PATCHES unset or off, MEGATRON_RL_PATCHES_DISABLE naming it, a list without it); None when
    it is selected."""
    select = environment["variables"][env.SELECT]
    if not environment["enabled_at_startup"]:
        state = "unset" if select is None else f"off ({env.SELECT}={_shown_setting(select)!r})"
        return (f"{env.SELECT} is {state}: nothing applies at start-up",
                f"set {env.SELECT}=all (or a list with {patch}), or start the job with `{PROG} run -- COMMAND ...` "
                f"(which selects every patch when {env.SELECT} is unset)")
    if patch in environment["resolved"]:
        return None
    disabled = environment["variables"][env.DISABLE]
    if fates.get(patch) == f"disabled by {env.DISABLE}":
        return (f"{env.DISABLE}={_shown_setting(disabled or '')!r} leaves it out",
                f"remove {patch} from {env.DISABLE}")
    return (f"{env.SELECT}={_shown_setting(select or '')!r} selects {', '.join(environment['resolved']) or 'nothing'}",
            f"add {patch} to {env.SELECT}, or set {env.SELECT}=all")


def opd_selection_problems(environment: dict[str, Any], fates: dict[str, str | None]) -> list[str]:
    """Top-k OPD's variables set while slime_opd is not selected: they would do nothing (issue 63)."""
    why = not_selected(environment, "slime_opd", fates) if environment["opd"] else None
    if why is None:
        return []
    return [f"slime_opd is not selected ({why[0]}), so the {OPD_PREFIX}* settings ({', '.join(environment['opd'])}) "
            f"do nothing: {why[1]}"]


def _shown_setting(value: str) -> str:
    """A variable's value as a problem quotes it (cut: a pasted megabyte must not flood the report)."""
    return settings.cut(redacted(value))


def teacher_report() -> tuple[list[str], list[str]]:
    """What slime_opd's teachers (MEGATRON_RL_PATCHES_OPD_TEACHERS) would fail on at load time,
    found now by each entry's kind (`teachers.kinds`) without loading anything: a path's files (a
    path that does not exist, a hub cache folder, a checkpoint's file instead of its directory, a
    Hugging Face directory the converter refuses, a `;tokenizer=own` teacher without its
    tokenizer.json), a served teacher's server (it answers, its model and max model length, k
    within its --max-logprobs: `ServedTeacher.check`, in bounded time); beside the problems, what
    was checked and held (a served teacher's URL, engine, route and model)."""
    settings = opd_settings()
    if settings is None:
        return [], []
    return entry_report(settings.teachers, RunFacts(ids_from=settings.ids_from, k=settings.k))


def teacher_problems() -> list[str]:
    """What `teacher_report` finds wrong."""
    return teacher_report()[0]


def collect() -> dict[str, Any]:
    """Everything `doctor` reports, as a JSON-ready dict, with a list of problems found."""
    problems: list[str] = []
    packages = {name: registry.installed_version(name) for name in DISTRIBUTIONS}
    problems += [f"{name} is not installed (a dependency of megatron-rl-patches)" for name in REQUIRED
                 if packages[name] is None]
    megatron, found = megatron_section()
    targets, target_problems = target_rows()
    environment, env_problems = environment_report()
    startup_files, editable, startup_problems = _startup_section(environment)
    problems += found + target_problems + env_problems + startup_problems
    report = {
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "packages": packages,
        "package": {
            "version": megatron_rl_patches.__version__,
            "location": os.path.dirname(megatron_rl_patches.__file__ or ""),
            "editable": editable,
        },
        "megatron": megatron,
        "targets": targets,
        "environment": environment,
        "startup": startup_files,
        "problems": list(dict.fromkeys(redacted(problem) for problem in problems)),  # whatever quoted a URL
    }
    report["summary"] = summary_of(report)
    # whatever a server said, a 200's fields too (a served model's name in a check's line): no piece of the API key
    return scrubbed_all(report)


def _show(value: Any) -> str:
    if value is None:
        return "-"
    text = str(value)
    return text if len(text) <= _SHOWN_VALUE else f"{text[:_SHOWN_VALUE - 3]}... ({len(text):,} characters)"


def _show_names(value: str | None) -> str:
    """A comma-separated list cut after its last whole name that fits (never mid-name)."""
    if value is None or len(value) <= _SHOWN_VALUE:
        return _show(value)
    kept = ""
    for name in value.split(","):
        longer = f"{kept},{name}" if kept else name
        if len(longer) > _SHOWN_VALUE - 4:
            break
        kept = longer
    return f"{kept},... ({len(value):,} characters)"


def _megatron_lines(m: dict[str, Any]) -> list[str]:
    if m["origin"] is None:
        return ["megatron-core        not found"]
    where = "installed distribution" if m["origin"] == "distribution" else "source checkout"
    lines = [f"megatron-core        {_show(m['version'])} ({where}: {m['location']})"]
    lane = m["tested_versions"].get(m["version"] or "")
    lines.append(f"{'':<21}supported '{m['supported']}': {m['tested']}" + (f" ({lane})" if lane else ""))
    return lines


def _target_lines(t: dict[str, Any], width: int = 20) -> list[str]:
    """A target's lines, its name padded to `width` (the longest patch name) so the columns align."""
    found = "module found" if t["module_found"] else f"module not found ({t['module_problem']})"
    if t["requires"] and t["versions"]:
        tested = t["tested"] or {True: "in range", False: "out of range", None: "version unknown"}[t["in_range"]]
        support = f"supported {t['requires']} '{t['versions']}'; {_show(t['installed'])}: {tested}"
        if t["native"]:
            support += " (provides the feature itself)"
        elif tested == "out of range":
            support = support.replace("out of range", "OUT OF RANGE")
    else:
        support = "no version guard (the parameter list is checked)"
    indent = " " * (width + 9)
    lines = [f"  {t['name']:<{width}} {t['shown']:<8} {t['target']}", f"  {indent} {found}; {support}"]
    if t["reason"] and t["shown"] not in ("off", "reverted", "applied"):
        lines.append(f"  {indent} {t['shown']}: {t['reason']}")
    return lines


def format_report(report: dict[str, Any]) -> str:
    """The text `doctor` prints."""
    py = report["python"]
    lines = summary_lines(report["summary"])
    lines.append(f"python               {py['version']} ({py['executable']})")
    lines += [f"{name:<20} {_show(version)}" for name, version in report["packages"].items()]
    pkg = report["package"]
    lines.append(f"package location     {pkg['location']}" + (" (editable)" if pkg["editable"] else ""))
    lines += _megatron_lines(report["megatron"])
    lines.append("patches (status, target; module, supported range, tested):")
    width = max([20, *(len(target["name"]) for target in report["targets"])])
    for target in report["targets"]:
        lines += _target_lines(target, width)
    e = report["environment"]
    lines.append("environment:")
    lines += [f"  {name}={_show_names(value) if name in LISTS else _show(value)}"
              for name, value in e["variables"].items()]
    if not e["enabled_at_startup"]:
        selects = "nothing"
    elif e["error"]:
        selects = "nothing (see the problems below)"
    else:  # what the variables select; whether it applies here is the summary's first line
        selects = ", ".join(e["resolved"])
        if e["resolved"] and not report["summary"]["applies_at_startup"]:
            selects += " (not applied here: no start-up file; see the problems below)"
    lines.append(f"  selected for start-up: {selects}")
    lines.append(f"  strict: {_show(e['strict'])}; allow untested: {_show(e['allow_untested'])}; "
                 f"inference roles: {_roles(e) or '-'}")
    lines += [f"  {line}" for line in shared_prefix_statement(e, _shown_setting)]
    lines += [f"  checked: {checked}" for checked in e.get("teachers_checked", [])]
    s = report["startup"]
    lines.append("start-up files:")
    lines += [f"  {f['path']}" + ("" if f["ours"] else " (NOT OURS)") for f in s["files"]] or ["  none installed"]
    lines.append(f"  start-up hook ran in this process: {s['bootstrap_ran']}")
    lines.append("problems:" if report["problems"] else "no problems found")
    lines += [f"  - {problem}" for problem in report["problems"]]
    return "\n".join(lines)


def _roles(environment: dict[str, Any]) -> str:
    """The inference roles as the variable gives them: `role:residency` where one is named."""
    modes = env.role_residencies(environment["variables"]) if environment["inference_roles"] else {}
    return ", ".join(f"{role}:{modes[role]}" if role in modes else role for role in environment["inference_roles"])


def run(args: argparse.Namespace) -> int:
    report = collect()
    if args.json:
        report["targets"] = [{k: v for k, v in t.items() if k != "shown"} for t in report["targets"]]
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
    return PROBLEM if report["problems"] else OK
