"""Start-up hook run by the installed .pth (and .start) file in every Python process.

With MEGATRON_RL_PATCHES unset it returns after one environment read and imports nothing more.
With it set, it registers post-import hooks; the patches land when megatron is imported.
It never raises: Python's site machinery would print a traceback (twice in a venv) and go on.
"""
# lazy imports: import cost: every process runs this hook; its import set is pinned (test_lazy_import)
from __future__ import annotations

import sys
import types

from megatron_rl_patches.patching import DEFAULT_REGISTRY, check_settings, env, load_registry
from megatron_rl_patches.settings import read_settings

TYPE_CHECKING = False  # not typing's: this module runs at start-up (see patching/env.py)
if TYPE_CHECKING:
    from collections.abc import Mapping

_done = False


def has_run() -> bool:
    """Whether the start-up hook already ran in this process."""
    return _done


# Imports that are about to run the hook (the .pth line, the launcher's sitecustomize, a script
# calling run()) or are the CLI (whose `doctor` reports it, and whose `run` is the fix): silent.
_SILENT_IMPORTS = ("megatron_rl_patches.patching", "megatron_rl_patches.apps",
                   "megatron_rl_patches.__main__")


def not_run_notice() -> str | None:
    """Why MEGATRON_RL_PATCHES does nothing in this process: it is set, but the start-up hook did
    not run (an editable install has no start-up file). None when that is not the case."""
    try:
        if _done or not env.is_enabled():
            return None
    except TypeError:
        return None
    value = env.shown_value(env.SELECT)
    return (
        f"{env.SELECT}={value!r} is set but start-up patching did not run in this process (no start-up "
        f"file: an editable install has none), so the variable alone patches nothing; start the job "
        f"with the launcher `megatron-rl-patches run -- COMMAND ...` (any install, writes nothing), or "
        f"run `megatron-rl-patches startup install` once to add the start-up file to this environment"
    )


def warn_if_not_run() -> None:
    """One warning (rank 0, once per process) when :func:`not_run_notice` has something to say."""
    notice = not_run_notice()
    if notice is not None:
        from megatron_rl_patches._log import warn_once

        warn_once(notice)


def warn_on_first_import() -> None:
    """:func:`warn_if_not_run` for the package's first import, unless that import is one of
    _SILENT_IMPORTS or `python -m megatron_rl_patches` (read from the import system's and
    runpy's frames: the name being imported or run)."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        code, names = frame.f_code.co_name, frame.f_locals
        if code == "_find_and_load" and _silent(str(names.get("name", ""))):
            return
        if code == "_run_module_as_main" and names.get("mod_name") == "megatron_rl_patches":  # the CLI
            return
        frame = frame.f_back
    warn_if_not_run()


def _silent(name: str) -> bool:
    return any(name == silent or name.startswith(f"{silent}.") for silent in _SILENT_IMPORTS)


_LINE_LIMIT = 2000  # characters of one start-up message


def _say(message: str) -> None:
    """One stderr line, from the first rank only (every rank would print the same). Never raises:
    stderr may be closed (None) or unwritable, and the user's program must start regardless."""
    try:
        from megatron_rl_patches.settings import launcher_rank

        if launcher_rank() == 0 and sys.stderr is not None:
            cut = message if len(message) <= _LINE_LIMIT else f"{message[: _LINE_LIMIT - 3]}..."
            sys.stderr.write(f"megatron-rl-patches: {cut}\n")
            sys.stderr.flush()
    except Exception:  # noqa: BLE001 - nowhere left to report it
        pass


def run(registry_factory: str = DEFAULT_REGISTRY) -> None:
    """Apply what the environment selects. Idempotent: a venv can execute the same .pth twice."""
    global _done  # not an argument: the interpreter runs the .pth line `import ...; run()`, which passes none
    if _done:
        return
    _done = True
    start(registry_factory=registry_factory)


# The variables the selection reads (a refusal: nothing applied), and the yes/no ones read first (a
# refusal: the default, off, and the patches applied): each said once, where it is read.
_SELECTION = (env.SELECT, env.DISABLE)
_DEFAULT_OFF = (env.STRICT, env.ALLOW_UNTESTED)


def start(environ: Mapping[str, str] | None = None, registry_factory: str = DEFAULT_REGISTRY) -> None:
    """What start-up does in a process whose environment is `environ` (default: its own): with
    MEGATRON_RL_PATCHES on, every variable read through its parser (`settings.read_settings`, as the
    launcher and `doctor` read it), the selected patches applied, and one line for each refusal (the
    policy for a setting's typo at start-up: say it, keep the default, patch anyway; a refused selection
    applies nothing). Never raises."""
    try:
        if not env.is_enabled(environ):
            return
        readings = read_settings(environ)
        for name in _DEFAULT_OFF:
            if name in readings.refusals:
                _say(f"{readings.refusals[name]}; using the default (off)")
        strict, allow_untested = (readings.values[name] is True for name in _DEFAULT_OFF)
        registry = load_registry(registry_factory)
        try:
            registry.apply(strict=strict, allow_untested=allow_untested, environ=environ)
        except ValueError as exc:  # a selection refused: one line now; strict: also at import
            _say(f"no patch applied at start-up: {exc}")
            if strict:
                registry.poison_imports(ValueError(f"{exc} ({env.STRICT} is set)"))
        said = [refusal for name, refusal in readings.refusals.items() if name not in _SELECTION + _DEFAULT_OFF]
        for refusal in said:  # read later, by the ops, the roles and the frameworks' patches
            _say(refusal)
        try:  # misspelled names, and what a framework refuses beyond the syntax (a served teacher's ids)
            check_settings(environ)
        except ValueError as exc:
            if str(exc) not in said:
                _say(str(exc))
    except BaseException as exc:  # noqa: BLE001 - start-up must go on whatever happens
        _say(f"start-up patching disabled: {type(exc).__name__}: {exc}")
