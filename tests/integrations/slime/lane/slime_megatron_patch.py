"""slime's Megatron patch in the lane: slime's image runs Megatron patched by slime's
`docker/patch/latest/megatron.patch`, whose GPT-model hunks give MTP training its semantics
(`GPTModel.forward(mtp_kwargs={"mtp_labels": tokens})`: the MTP heads run only with those labels,
rolled once more than megatron's own, with a rolled loss mask and a detached output weight).

`tools/slime-lane` writes the installed megatron-core's `gpt_model.py` and
`multi_token_prediction.py` with those hunks applied into `<lane>/megatron-core-slime` (the
installed package stays untouched); `install()` loads these two modules from there, in place of
the installed ones, by a meta-path finder registered before megatron-core is imported (the lane's
conftest, and every spawned rank). Every other module is the installed megatron-core 0.16.1's.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from typing import Any

DIRECTORY = "megatron-core-slime"
MODULES = {
    "megatron.core.models.gpt.gpt_model": ("models", "gpt", "gpt_model.py"),
    "megatron.core.transformer.multi_token_prediction": ("transformer", "multi_token_prediction.py"),
}
MISSING = ("the slime lane has no {path}: re-run tools/slime-lane (it applies slime's GPT-model patch to copies "
           "of the installed megatron-core's gpt_model.py and multi_token_prediction.py)")


def overlay() -> str:
    """`<lane>/megatron-core-slime/megatron/core`: the lane root holds the exported Megatron-LM tree."""
    spec = importlib.util.find_spec("megatron.training")
    if spec is None or spec.origin is None:
        raise RuntimeError("the slime lane's Megatron-LM tree (megatron.training) is not importable")
    lane = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(spec.origin))))
    return os.path.join(lane, DIRECTORY, "megatron", "core")


class _PatchedModules(importlib.abc.MetaPathFinder):
    def __init__(self, root: str) -> None:
        self.files = {name: os.path.join(root, *parts) for name, parts in MODULES.items()}

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        file = self.files.get(name)
        return None if file is None else importlib.util.spec_from_file_location(name, file)


def install() -> None:
    """Load the two patched modules in place of the installed ones (idempotent). Raises when they
    are missing, or when megatron-core's originals were imported first."""
    if any(isinstance(finder, _PatchedModules) for finder in sys.meta_path):
        return
    root = overlay()
    finder = _PatchedModules(root)
    for name, file in finder.files.items():
        if not os.path.isfile(file):
            raise RuntimeError(MISSING.format(path=file))
        module = sys.modules.get(name)
        if module is not None and os.path.abspath(getattr(module, "__file__", "")) != os.path.abspath(file):
            raise RuntimeError(f"{name} was imported from {module.__file__} before the slime lane loaded slime's "
                               "patched copy: install the patch before anything imports megatron.core")
    sys.meta_path.insert(0, finder)


def active() -> bool:
    """Whether GPTModel.forward is slime's patched one (it takes `mtp_kwargs`)."""
    import inspect

    from megatron.core.models.gpt.gpt_model import GPTModel

    return "mtp_kwargs" in inspect.signature(GPTModel.forward).parameters
