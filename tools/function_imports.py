"""List every import statement inside a function or method of megatron_rl_patches/ (read with `ast`),
with the reason it states: `# lazy: <reason>` trailing the statement or on the comment line right
above it, else the module's note, a line `# lazy imports: <reason>` at column 0 that covers every
other lazy import of that file. Reasons name what holds the import back, e.g. "optional dependency
megatron-core", "import cost: ...", "cycle A <-> B", "megatron version-dependent: ...", "order: ...".

    python tools/function_imports.py                # counts by kind (own, torch, megatron, stdlib, other)
    python tools/function_imports.py --by-module    # the counts per module
    python tools/function_imports.py --list         # one line each: path:line kind name [reason]
    python tools/function_imports.py --unexplained  # only those with no reason; exit 1 when any

tests/test_function_imports.py holds the package to "every one has a reason" with `unexplained()`.
"""
from __future__ import annotations

import argparse
import ast
import re
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "megatron_rl_patches"
KINDS = ("own", "torch", "megatron", "stdlib", "other")
LINE_REASON = re.compile(r"#\s*lazy:\s*(\S.*)$")
MODULE_REASON = re.compile(r"^#\s*lazy imports:\s*(\S.*)$", re.M)


@dataclass(frozen=True)
class FunctionImport:
    path: str  # relative to the repository
    line: int
    name: str  # the module named: `import a.b` -> a.b; `from .x import y` -> .x
    kind: str  # one of KINDS
    reason: str  # "" when none is stated
    top: str = ""  # the top-level package named (the package's own name for a relative import)


def kind_of(node: ast.Import | ast.ImportFrom) -> tuple[str, str]:
    if isinstance(node, ast.ImportFrom):
        name = "." * node.level + (node.module or "")
        if node.level:
            return name, "own"
    else:
        name = ", ".join(alias.name for alias in node.names)
    top = name.split(".")[0]
    if top == PACKAGE:
        return name, "own"
    if top in ("torch", "megatron"):
        return name, top
    if top in sys.stdlib_module_names or top == "__future__":
        return name, "stdlib"
    return name, "other"


def in_functions(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements below a def (at any depth), not those at module or class level."""

    def visit(node: ast.AST, inside: bool) -> Iterator[ast.Import | ast.ImportFrom]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)) and inside:
                yield child
            deeper = inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from visit(child, deeper)

    yield from visit(tree, False)


def scan_file(path: Path, root: Path = REPO) -> list[FunctionImport]:
    text = path.read_text()
    lines = text.splitlines()
    note = MODULE_REASON.search(text)
    found = []
    for node in in_functions(ast.parse(text, str(path))):
        name, kind = kind_of(node)
        above = lines[node.lineno - 2 : node.lineno - 1] if node.lineno > 1 else []
        span = [line for line in above if line.strip().startswith("#")]
        span += lines[node.lineno - 1 : (node.end_lineno or node.lineno)]
        stated = next((m.group(1) for m in map(LINE_REASON.search, span) if m), None)
        reason = stated or (note.group(1) if note else "")
        top = PACKAGE if name.startswith(".") else name.split(".")[0]
        found.append(FunctionImport(str(path.relative_to(root)), node.lineno, name, kind, reason.strip(), top))
    return found


def module_level_tops(path: Path) -> set[str]:
    """The top-level packages a file imports unconditionally at module level (not under `if`/`try`)."""
    tops = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            tops.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            tops.add(PACKAGE if node.level else (node.module or "").split(".")[0])
    return tops


def scan(root: Path = REPO) -> list[FunctionImport]:
    return [item for path in sorted((root / PACKAGE).rglob("*.py")) for item in scan_file(path, root)]


def unexplained(root: Path = REPO) -> list[FunctionImport]:
    return [item for item in scan(root) if not item.reason]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--by-module", action="store_true")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--unexplained", action="store_true")
    args = parser.parse_args(argv)
    items = scan()
    if args.unexplained:
        items = [item for item in items if not item.reason]
    if args.list or args.unexplained:
        for item in items:
            print(f"{item.path}:{item.line} {item.kind} {item.name}" + (f"  [{item.reason}]" if item.reason else ""))
    elif args.by_module:
        per = Counter((item.path, item.kind) for item in items)
        for path in sorted({item.path for item in items}):
            counts = ", ".join(f"{kind} {per[path, kind]}" for kind in KINDS if per[path, kind])
            print(f"{path}: {counts}")
    else:
        kinds = Counter(item.kind for item in items)
        print(f"{len(items)} imports inside functions: " + ", ".join(f"{k} {kinds[k]}" for k in KINDS))
        reasons = Counter(item.reason or "(no reason)" for item in items)
        for reason, count in reasons.most_common():
            print(f"  {count:4d}  {reason}")
    return 1 if args.unexplained and items else 0


if __name__ == "__main__":
    sys.exit(main())
