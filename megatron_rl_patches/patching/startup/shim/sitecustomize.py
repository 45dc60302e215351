"""Start-up hook of `megatron-rl-patches run`: apply the selected patches, then run the
`sitecustomize` this one shadows (the next one on sys.path), if any, as if it had been found first.

Like every start-up path it never raises: Python would print a traceback and go on.
"""
import importlib.machinery
import importlib.util
import os
import sys


def _run_ours() -> None:
    if importlib.util.find_spec("megatron_rl_patches") is None:
        # The launcher's own package folder, put last: never shadows the child's own packages.
        package_root = os.environ.get("MEGATRON_RL_PATCHES_LAUNCHER_ROOT", "")
        if package_root and package_root not in sys.path:
            sys.path.append(package_root)
    try:
        # lazy: order: the package imports once the lines above put its root on sys.path (a failure is caught)
        from megatron_rl_patches.patching.startup import hook
    except Exception as exc:  # noqa: BLE001 - the child must run regardless
        try:
            sys.stderr.write(f"megatron-rl-patches: launcher could not import the package: {exc}\n")
        except Exception:  # noqa: BLE001 - stderr closed or full
            pass
        return
    hook.run()


def _run_shadowed() -> None:
    """Execute the next `sitecustomize` on sys.path (a venv's, a distribution's, the user's own)."""
    here = os.path.realpath(os.path.dirname(__file__))
    rest = [p for p in sys.path if os.path.realpath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module  # what the rest of the process sees, as without us
    try:
        spec.loader.exec_module(module)
    except Exception:  # noqa: BLE001 - what Python does with a failing sitecustomize: report, go on
        import traceback  # lazy: import cost: only when the shadowed sitecustomize fails

        try:
            sys.stderr.write(f"Error in sitecustomize ({spec.origin}); set PYTHONVERBOSE for traceback:\n")
            traceback.print_exc()
        except Exception:  # noqa: BLE001
            pass


_run_ours()
_run_shadowed()
