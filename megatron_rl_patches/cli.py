"""`megatron-rl-patches` (also `python -m megatron_rl_patches`): list, doctor, startup, demo, bench,
memory.

Each sub-command lives in the module its COMMANDS entry names ("module" or "module:object"),
which provides `add_arguments(parser)` and `run(args) -> int`. Only the module of the command
being run is imported, so `--help` and the light commands stay cheap. Exit codes: 0 ok,
1 failure, 2 usage error (also: a command this installation does not have).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
from types import SimpleNamespace
from typing import Any, Sequence

PROG = "megatron-rl-patches"
OK, FAILURE, USAGE = 0, 1, 2

# sub-command -> (where add_arguments/run live, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "list": ("megatron_rl_patches.cli:LIST", "patches, their targets, version ranges and statuses"),
    "doctor": ("megatron_rl_patches.cli:DOCTOR", "versions, importable targets, environment, start-up files"),
    "startup": ("megatron_rl_patches.cli:STARTUP", "install or remove the start-up file (editable installs)"),
    "demo": ("megatron_rl_patches.demo", "a tiny real megatron-core RL loop, with and without the patches"),
    "bench": ("megatron_rl_patches.bench.cli", "benchmarks: log-prob and top-k losses (memory, time), re-entrant wrapper cost"),
    "memory": ("megatron_rl_patches.memory_cli", "training-state bytes an inference-only build saves"),
}

# Versions `doctor` reports (distribution names).
DISTRIBUTIONS = ("torch", "megatron-core", "wrapt", "packaging", "megatron-rl-patches")
REQUIRED = ("torch", "megatron-core", "wrapt", "packaging")


class CommandUnavailable(Exception):
    """The module of a sub-command is not part of this installation."""


def _load(command: str) -> Any:
    """Import the object that implements `command` (see COMMANDS)."""
    ref = COMMANDS[command][0]
    module_name, _, attribute = ref.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing == module_name or module_name.startswith(missing + "."):
            raise CommandUnavailable(
                f"{PROG} {command}: not available in this installation (module {module_name} "
                f"is missing): a partial installation; reinstall megatron-rl-patches"
            ) from exc
        raise
    for part in filter(None, attribute.split(".")):
        obj = getattr(obj, part)
    if not (callable(getattr(obj, "add_arguments", None)) and callable(getattr(obj, "run", None))):
        raise TypeError(f"{ref} must provide add_arguments(parser) and run(args) -> int")
    return obj


def _selected_command(argv: Sequence[str]) -> str | None:
    """The sub-command argv names (the first positional word; no top-level option takes a value)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def build_parser(command: str | None = None) -> tuple[argparse.ArgumentParser, Any]:
    """The argument parser, with the arguments of `command` only (whose module is imported)."""
    from megatron_rl_patches import __version__

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Monkeypatches, wrappers and memory-optimal losses for Megatron-core RL post-training.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    implementation = None
    for name, (_, help_text) in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            implementation = _load(name)
            implementation.add_arguments(sub_parser)
    return parser, implementation


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _selected_command(argv)
    try:
        parser, implementation = build_parser(command if command in COMMANDS else None)
    except CommandUnavailable as exc:
        print(exc, file=sys.stderr)
        return USAGE
    except ModuleNotFoundError as exc:
        print(f"{PROG} {command}: needs the module {exc.name!r}, which is not installed", file=sys.stderr)
        return FAILURE
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error (argparse printed why)
        return exc.code if isinstance(exc.code, int) else USAGE
    if implementation is None:
        parser.print_help(sys.stderr)
        return USAGE
    try:
        return int(implementation.run(args) or 0)
    except KeyboardInterrupt:
        return 130


# ---------------------------------------------------------------------------- list


def _list_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print a JSON list")
    parser.add_argument(
        "--apply",
        action="store_true",
        help="first apply what the environment selects, as the start-up file does in every process",
    )
    parser.add_argument(
        "--import",
        dest="import_targets",
        action="store_true",
        help="then import every installed target module so pending patches land (imports megatron: slow)",
    )


def _installed(distribution: str | None) -> str | None:
    if not distribution:
        return None
    from megatron_rl_patches.patching.registry import installed_version

    return installed_version(distribution)


def _import_targets(modules: Sequence[str]) -> dict[str, str]:
    """Import each installed module; returns module -> problem for those that failed."""
    from megatron_rl_patches.patching.registry import PatchError

    problems = {}
    for module in modules:
        if not find_module(module)[0]:
            continue
        try:
            importlib.import_module(module)
        except PatchError as exc:  # strict mode: the post-import hook raised
            problems[module] = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # noqa: BLE001 - a broken optional framework: report it, go on
            problems[module] = f"import failed: {type(exc).__name__}: {exc}"
    return problems


def default_registry():
    from megatron_rl_patches.integrations import default_registry as get

    return get()


def _run_list(args: argparse.Namespace) -> int:
    from megatron_rl_patches.patching import env, registry

    if args.apply:
        if not env.is_enabled():
            print(f"note: {env.SELECT} is not set: start-up applies nothing", file=sys.stderr)
        else:
            try:
                default_registry().apply()
            except ValueError as exc:
                print(f"{PROG} list: {exc}", file=sys.stderr)
                return USAGE
            except registry.PatchError as exc:
                print(f"{PROG} list: {type(exc).__name__}: {exc}", file=sys.stderr)
                return FAILURE
    import_problems: dict[str, str] = {}
    if args.import_targets:
        import_problems = _import_targets(list(dict.fromkeys(p.module for p in default_registry().patches())))
    rows = [
        {
            "name": patch.name,
            "target": patch.target,
            "requires": patch.requires,
            "versions": patch.versions,
            "installed": _installed(patch.requires),
            "description": patch.description,
            "status": status.status,
            "reason": status.reason,
        }
        for patch, status in default_registry().entries()
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(_format_list(rows))
    for module, problem in import_problems.items():
        print(f"{PROG} list: {module}: {problem}", file=sys.stderr)
    return FAILURE if import_problems else OK


def _format_list(rows: list[dict[str, Any]]) -> str:
    width = max(len(row["name"]) for row in rows) if rows else 4
    lines = [f"{'PATCH':<{width}}  {'STATUS':<8}  TARGET"]
    for row in rows:
        if row["requires"]:
            found = row["installed"] or "not installed"
            versions = f"{row['requires']} {row['versions'] or 'any version'} (installed: {found})"
        else:
            versions = "no version guard (the parameter list is checked)"
        lines.append(f"{row['name']:<{width}}  {row['status']:<8}  {row['target']}")
        pad = " " * (width + 12)
        lines.append(f"{pad}{row['description']}")
        lines.append(f"{pad}{versions}")
        if row["reason"]:
            lines.append(f"{pad}{row['status']}: {row['reason']}")
    return "\n".join(lines)


LIST = SimpleNamespace(add_arguments=_list_arguments, run=_run_list)


# ---------------------------------------------------------------------------- doctor


def _doctor_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print a JSON object")


def find_module(name: str) -> tuple[bool, str | None]:
    """Whether module `name` can be found, without running any package __init__ not yet imported
    (importlib.util.find_spec would import the parents: megatron, torch...). -> (found, problem)."""
    parts = name.split(".")
    path = None
    for depth in range(1, len(parts) + 1):
        fullname = ".".join(parts[:depth])
        module = sys.modules.get(fullname)
        if module is not None:
            path = getattr(module, "__path__", None)
        else:
            try:
                spec = _find_spec_without_import(fullname, path)
            except Exception as exc:  # noqa: BLE001 - a broken finder: report, do not crash
                return False, f"looking for {fullname} failed: {type(exc).__name__}: {exc}"
            if spec is None:
                return False, f"{fullname} is not installed" if depth == 1 else f"{fullname} not found"
            path = spec.submodule_search_locations
        if depth < len(parts) and path is None:
            return False, f"{fullname} is a module, not a package"
    return True, None


def _find_spec_without_import(fullname: str, path: Any) -> Any:
    for finder in sys.meta_path:
        # wrapt's post-import finder resolves through importlib.util.find_spec (imports parents)
        if type(finder).__module__.startswith("wrapt"):
            continue
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        spec = find_spec(fullname, path)
        if spec is not None:
            return spec
    return None


def _editable_install() -> bool | None:
    """Whether megatron-rl-patches is installed in editable mode (None: not installed)."""
    import importlib.metadata

    # A source checkout's *.egg-info on sys.path is listed too: the installer's record decides.
    dists = list(importlib.metadata.distributions(name="megatron-rl-patches"))
    for dist in dists:
        text = dist.read_text("direct_url.json")
        if text:
            try:
                return bool(json.loads(text).get("dir_info", {}).get("editable", False))
            except (ValueError, AttributeError):
                return None
    return False if dists else None


def collect_doctor() -> dict[str, Any]:
    """Everything `doctor` reports, as a JSON-ready dict, with a list of problems found."""
    import megatron_rl_patches
    from megatron_rl_patches.patching import bootstrap, env, registry, startup

    problems: list[str] = []
    packages = {name: registry.installed_version(name) for name in DISTRIBUTIONS}
    for name in REQUIRED:
        if packages[name] is None:
            problems.append(f"{name} is not installed (a dependency of megatron-rl-patches)")

    modules: dict[str, tuple[bool, str | None]] = {}
    targets = []
    for patch in default_registry().patches():
        if patch.module not in modules:
            modules[patch.module] = find_module(patch.module)
        found, why = modules[patch.module]
        installed = registry.patch_version(patch)
        problem = registry.version_problem(patch) if (patch.requires and patch.versions) else None
        in_range = None if installed is None or not patch.versions else problem is None
        if problem and found:
            problems.append(f"'{patch.name}': {problem}")
        targets.append(
            {
                "name": patch.name,
                "target": patch.target,
                "module_found": found,
                "module_problem": why,
                "requires": patch.requires,
                "versions": patch.versions,
                "installed": installed,
                "in_range": in_range,
            }
        )
    problems = list(dict.fromkeys(problems))

    environment: dict[str, Any] = env.summary()
    try:
        environment["resolved"] = env.resolve_selection(default_registry().patch_names()) if env.is_enabled() else []
        environment["error"] = None
    except ValueError as exc:
        environment["resolved"], environment["error"] = None, str(exc)
        problems.append(str(exc))

    files = [f for d in startup.site_dirs() for f in startup.inspect_dir(d) if f.present]
    pth_installed = any(f.ours and f.path.endswith(startup.PTH_NAME) for f in files)
    for f in files:
        if not f.ours:
            problems.append(f"{f.path} exists but is not megatron-rl-patches' start-up file")
    editable = _editable_install()
    if environment["enabled_at_startup"] and not pth_installed:
        problems.append(
            f"{env.SELECT} is set but no start-up file is installed in this interpreter's site "
            f"directories, so nothing applies without code; run `{PROG} startup install`"
            + (" (editable installs do not get it from pip)" if editable else "")
        )
    return {
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "packages": packages,
        "package": {
            "version": megatron_rl_patches.__version__,
            "location": os.path.dirname(megatron_rl_patches.__file__ or ""),
            "editable": editable,
        },
        "targets": targets,
        "environment": environment,
        "startup": {
            "pth_installed": pth_installed,
            "files": [f.as_dict() for f in files],
            "site_dirs": startup.site_dirs(),
            "bootstrap_ran": bootstrap.has_run(),
        },
        "problems": problems,
    }


def _format_doctor(report: dict[str, Any]) -> str:
    def show(value: Any) -> str:
        return "-" if value is None else str(value)

    py = report["python"]
    lines = [f"python               {py['version']} ({py['executable']})"]
    lines += [f"{name:<20} {show(version)}" for name, version in report["packages"].items()]
    pkg = report["package"]
    lines.append(f"package location     {pkg['location']}" + (" (editable)" if pkg["editable"] else ""))
    lines.append("targets:")
    for t in report["targets"]:
        found = "found" if t["module_found"] else f"not found ({t['module_problem']})"
        if t["requires"] and t["versions"]:
            rng = {True: "in range", False: "OUT OF RANGE", None: "version unknown"}[t["in_range"]]
            version = f"{t['requires']} {show(t['installed'])} vs '{t['versions']}': {rng}"
        else:
            version = "no version guard"
        lines.append(f"  {t['name']:<16} {t['target']}")
        lines.append(f"  {'':<16} module {found}; {version}")
    e = report["environment"]
    lines.append("environment:")
    lines += [f"  {name}={show(value)}" for name, value in e["variables"].items()]
    selects = "nothing at start-up" if not e["enabled_at_startup"] else (e["error"] or ", ".join(e["resolved"]))
    lines.append(f"  start-up applies: {selects}")
    lines.append(f"  strict: {e['strict']}; inference roles: {', '.join(e['inference_roles']) or '-'}")
    s = report["startup"]
    lines.append("start-up files:")
    lines += [f"  {f['path']}" + ("" if f["ours"] else " (NOT OURS)") for f in s["files"]] or ["  none installed"]
    lines.append(f"  start-up hook ran in this process: {s['bootstrap_ran']}")
    lines.append("problems:" if report["problems"] else "no problems found")
    lines += [f"  - {problem}" for problem in report["problems"]]
    return "\n".join(lines)


def _run_doctor(args: argparse.Namespace) -> int:
    report = collect_doctor()
    print(json.dumps(report, indent=2) if args.json else _format_doctor(report))
    return FAILURE if report["problems"] else OK


DOCTOR = SimpleNamespace(add_arguments=_doctor_arguments, run=_run_doctor)


# ---------------------------------------------------------------------------- startup


def _startup_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("install", "remove"), help="write or delete the start-up files")
    parser.add_argument(
        "--site",
        metavar="DIR",
        default=None,
        help="site-packages directory (default: the running interpreter's)",
    )


def _run_startup(args: argparse.Namespace) -> int:
    from megatron_rl_patches.patching import startup

    try:
        done = startup.install(args.site) if args.action == "install" else startup.remove(args.site)
    except NotADirectoryError as exc:
        print(f"{PROG} startup: {exc}", file=sys.stderr)
        return USAGE
    except (startup.ForeignStartupFile, OSError) as exc:
        print(f"{PROG} startup: {exc}", file=sys.stderr)
        return FAILURE
    for path, what in done:
        print(f"{what:<9} {path}")
    site_dir = os.path.dirname(done[0][0])
    if args.action == "install" and not startup.is_site_dir(site_dir):
        print(
            f"note: {site_dir} is not a site directory of {sys.executable}; only interpreters "
            "that read .pth files from it will run the start-up hook",
            file=sys.stderr,
        )
    return OK


STARTUP = SimpleNamespace(add_arguments=_startup_arguments, run=_run_startup)
