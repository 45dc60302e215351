"""Running documentation blocks: python in a namespace, the `$ ` commands of a CLI block, output
comparison (whitespace-normalized, `...` lines stand for any lines), signature listings."""
from __future__ import annotations

import ast
import contextlib
import inspect
import io
import re
from collections.abc import Iterator
from typing import Any

from doc_blocks import REPO, Block

ELLIPSIS = "..."


def _normalized(text: str) -> list[str]:
    lines = [" ".join(line.split()) for line in text.strip("\n").splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    while lines and not lines[0]:
        lines.pop(0)
    return lines


def output_matches(expected: str, actual: str) -> bool:
    """Line by line after whitespace normalization; an expected line `...` matches any lines."""
    want, got = _normalized(expected), _normalized(actual)

    def match(i: int, j: int) -> bool:
        if i == len(want):
            return j == len(got)
        if want[i] == ELLIPSIS:
            return any(match(i + 1, k) for k in range(j, len(got) + 1))
        return j < len(got) and want[i] == got[j] and match(i + 1, j + 1)

    return match(0, 0)


def assert_output(block: Block, actual: str, what: str) -> None:
    assert output_matches(block.text, actual), (
        f"{block.where}: the block shows what {what} does not print.\n--- shown\n{block.text}--- printed\n{actual}"
    )


def run_python(block: Block, namespace: dict, replace: dict[str, str]) -> str:
    """Execute the block in `namespace`; returns its stdout. Tracebacks name the markdown lines."""
    source = block.text
    for literal, value in replace.items():
        source = source.replace(literal, value)
    code = compile("\n" * block.line + source, str(REPO / block.page), "exec")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, namespace)
    return out.getvalue()


def cli_commands(block: Block) -> Iterator[tuple[str, str]]:
    """(command, the output shown under it) for each `$ ` line, `\\` continuations joined."""
    lines = block.text.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("$ "):
            i += 1
            continue
        command = lines[i][2:]
        while command.endswith("\\"):
            i += 1
            command = command[:-1].rstrip() + " " + lines[i].strip()
        i += 1
        output = []
        while i < len(lines) and not lines[i].startswith("$ "):
            output.append(lines[i])
            i += 1
        yield command, "\n".join(output) + "\n"


def listed_signatures(text: str) -> dict[str, ast.arguments]:
    """`name(params) -> result` entries of a signature listing, parsed as `def name(params)`."""
    found, i = {}, 0
    for start in re.finditer(r"^(\w+)\(", text, flags=re.M):
        if start.start() < i:
            continue
        depth, j = 0, start.end() - 1
        while True:
            depth += {"(": 1, ")": -1}.get(text[j], 0)
            if depth == 0:
                break
            j += 1
        name, params = start.group(1), text[start.end() : j]
        found[name] = ast.parse(f"def {name}({params}): pass").body[0].args
        i = j
    return found


def signature_mismatches(name: str, listed: ast.arguments, real: Any) -> list[str]:
    """Differences between a listed signature and the real function's: names, kinds, defaults."""
    params = list(inspect.signature(real).parameters.values())
    shown = []
    positional = listed.posonlyargs + listed.args
    defaults = [None] * (len(positional) - len(listed.defaults)) + list(listed.defaults)
    for arg, default in zip(positional, defaults):
        shown.append((arg.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD, default))
    for arg, default in zip(listed.kwonlyargs, listed.kw_defaults):
        shown.append((arg.arg, inspect.Parameter.KEYWORD_ONLY, default))
    problems = []
    if [s[0] for s in shown] != [p.name for p in params]:
        problems.append(f"{name}: parameters {[s[0] for s in shown]} shown, {[p.name for p in params]} real")
        return problems
    for (arg, kind, default), param in zip(shown, params):
        if param.kind != kind and not (kind == inspect.Parameter.POSITIONAL_OR_KEYWORD
                                       and param.kind == param.POSITIONAL_ONLY):
            problems.append(f"{name}: {arg} shown {kind.description}, real {param.kind.description}")
        has_default = param.default is not inspect.Parameter.empty
        if (default is not None) != has_default:
            problems.append(f"{name}: {arg} shown {'with' if default is not None else 'without'} a default")
        elif default is not None and ast.literal_eval(default) != param.default:
            problems.append(f"{name}: {arg}={ast.unparse(default)} shown, {param.default!r} real")
    return problems
