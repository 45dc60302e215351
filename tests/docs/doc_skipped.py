"""What can still be checked in a block the docs test cannot run (`<!-- docs-test: skip: ... -->`):
python parses and every name it imports from this package exists; shell lines name real make
targets, real sub-commands of the CLI, known environment variables and known patch names; a test
file the skip reason points to exists. A block with none of these is not a test at all."""
from __future__ import annotations

import ast
import importlib
import re
import shlex
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
Check = Callable[[], None]


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([A-Za-z][\w-]*):", text, re.M)}


def _python_checks(text: str, where: str) -> list[Check]:
    def parses() -> None:
        ast.parse(text, filename=where)

    checks: list[Check] = [parses]
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return checks
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron_rl_patches"):
            for alias in node.names:
                checks.append(lambda module=node.module, name=alias.name: _has(module, name, where))
    return checks


def _has(module: str, name: str, where: str) -> None:
    assert hasattr(importlib.import_module(module), name), f"{where}: {module} has no {name}"


def _shell_checks(text: str, where: str) -> list[Check]:
    from megatron_rl_patches.apps.cli import COMMANDS
    from megatron_rl_patches.integrations import all_patches
    from megatron_rl_patches.patching import env

    checks: list[Check] = []
    patch_names = {p.name for p in all_patches()}
    for line in text.replace("\\\n", " ").splitlines():
        line = line.split("#", 1)[0].strip().removeprefix("export ").removeprefix("$ ")
        if not line:
            continue
        try:
            words = shlex.split(line.replace("<", "").replace(">", "").replace("[", "").replace("]", ""))
        except ValueError:
            continue
        for i, word in enumerate(words):
            if word == "make" and i + 1 < len(words) and not words[i + 1].startswith("-"):
                checks.append(lambda t=words[i + 1]: _in(t, _make_targets(), "make target", where))
            if word == "megatron-rl-patches" and i + 1 < len(words) and not words[i + 1].startswith("-"):
                checks.append(lambda c=words[i + 1]: _in(c, set(COMMANDS), "sub-command", where))
            if re.fullmatch(r"MEGATRON_RL_PATCHES\w*=.*", word):
                name, value = word.split("=", 1)
                checks.append(lambda n=name: _in(n, set(env.VARIABLES), "environment variable", where))
                if name == env.SELECT and value not in ("all", "1"):
                    for patch in filter(None, value.split(",")):
                        checks.append(lambda p=patch: _in(p, patch_names, "patch name", where))
    return checks


def _in(value: str, known: set[str], what: str, where: str) -> None:
    assert value in known, f"{where}: {value!r} is not a {what} (known: {sorted(known)})"


def _reason_checks(reason: str, where: str) -> list[Check]:
    return [lambda p=path: _exists(p, where) for path in re.findall(r"tests/[\w/]+\.py", reason)]


def _exists(path: str, where: str) -> None:
    assert (ROOT / path).is_file(), f"{where}: the skip reason names {path}, which does not exist"


def skipped_block_checks(lang: str, text: str, reason: str, where: str) -> list[Check]:
    """The checks a skipped block still gets (empty: nothing checkable)."""
    checks = _reason_checks(reason, where)
    if lang == "python":
        return checks + _python_checks(text, where)
    return checks + _shell_checks(text, where)
