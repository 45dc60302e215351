"""docs/design.md's layer picture, checked on the source: every import of every module of the package
(top level and inside functions, read with `ast`), mapped to rooms, against the rules

- `ops` imports no `patching`, `integrations`, app, `testing`, nor megatron (third-party `megatron.*`);
- nothing in the library (everything but the apps and `testing`) imports an app or `testing`;
- `patching` imports no `integrations` (it names the default registry by a string);
- `cross_tokenizer` imports the ops (and `_lazy`) only: no patching, integrations, inference,
  processors, app, `testing`, nor megatron;
- `teachers` (the framework-free teacher contract, served teachers) imports no patching,
  integrations, processors, app, `testing`, nor megatron: the integrations build on it;
- `shared_prefix` imports the ops and megatron-core only: no patching, integrations, inference,
  processors, teachers, app nor `testing`;
- `model` (what the package knows about a Megatron model) imports nothing of the package but `_log`,
  so every room may use it; the `ops` (framework-free math) do not;
- no cycle between rooms (a room may import itself);
- no cycle between modules inside a room either (function-level and `TYPE_CHECKING` imports count:
  a cycle hidden in a function is still two modules that cannot be understood apart).

The checker is tested on small synthetic graphs too, so a rule that can no longer fail shows."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import megatron_rl_patches

PACKAGE = "megatron_rl_patches"
ROOT = Path(megatron_rl_patches.__file__).resolve().parent

# Sub-packages / modules -> room. A module is in the room of its first name below the package.
ROOMS = {
    "ops": "ops",
    "patching": "patching",
    "integrations": "integrations",
    "inference": "inference",
    "processors": "processors",  # output processors and the GPT `output_processor` backport
    "megatron": "processors",  # the processors' earlier path, kept as an alias package (users type it)
    "testing": "testing",
    "cross_tokenizer": "cross_tokenizer",  # alignment between two tokenizers: ops and torch only
    "teachers": "teachers",  # the framework-free teacher contract and served teachers: downhill of integrations
    "shared_prefix": "shared_prefix",  # a group's prompt once: the plan, its attention, the model's seams
    "model": "model",  # what the package knows about a Megatron model: chunks, unwrap, arguments, attention layout
    # leaves and small rooms of their own
    "reentrant": "reentrant",
    "windows": "windows",
    "settings": "settings",  # every setting: its name, meaning, syntax, and the one reader of the environment
    "_log": "_log",
    "_lazy": "_lazy",
    "_aliases": "_aliases",
}
# The apps: under apps/ (issue 20 item 6); their former names at the package root still count
# as apps, so one put back there is held to the same rules.
APPS = {"apps", "cli", "demo", "bench", "presentation", "__main__"}
MEGATRON = "megatron-core"  # the room of third-party `megatron.*` imports
LIBRARY_EXEMPT = {"testing"} | {"apps"}  # rooms the "no app, no testing" rule does not bind

# Known violations, each removed by a named issue item: (importing room, imported room) -> why.
EXCEPTIONS: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_names(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Every module name an import statement anywhere in `tree` names: `import a.b` gives a.b,
    `from a import b` gives a and a.b (b may be a submodule; unknown names are dropped later)."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def package_graph() -> dict[str, set[str]]:
    """module -> modules it imports: ours (when they exist) and third-party `megatron.*`."""
    files = {module_name(path): path for path in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        names = imported_names(ast.parse(path.read_text(), str(path)), module, path.name == "__init__.py")
        graph[module] = {n for n in names if n in files or n == "megatron" or n.startswith("megatron.")}
    return graph


def module_graph() -> dict[str, set[str]]:
    """module -> modules of the package it imports, read precisely: `from pkg import sub` is an
    edge to the submodule `pkg.sub` only (not to `pkg`'s `__init__`); `from pkg import name` (not a
    module) and `import pkg` are edges to `pkg`."""
    files = {module_name(path): path for path in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        package = module if is_package else module.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                for alias in node.names:
                    found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base)
        graph[module] = {name for name in found if name in files and name != module}
    return graph


def module_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            nxt = next(successors, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def room(module: str) -> str:
    if module == "megatron" or module.startswith("megatron."):
        return MEGATRON
    parts = module.split(".")
    if len(parts) == 1:
        return "root"  # the package's lazy public names
    if parts[1] in APPS:
        return "apps"
    if parts[1] not in ROOMS:
        raise KeyError(f"{module} is in no room: add {parts[1]!r} to ROOMS or APPS in {__file__}")
    return ROOMS[parts[1]]


def room_graph(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """(importing room, imported room) -> the module-level imports that make that edge."""
    edges: dict[tuple[str, str], list[str]] = {}
    for module, targets in graph.items():
        for target in sorted(targets):
            edges.setdefault((room(module), room(target)), []).append(f"{module} -> {target}")
    return edges


def cycles(edges: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    """Strongly connected components of more than one room (Tarjan's algorithm)."""
    successors: dict[str, set[str]] = {}
    for a, b in edges:
        successors.setdefault(a, set())
        successors.setdefault(b, set())
        if a != b:
            successors[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(successors[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(successors):
        if node not in index:
            visit(node)
    return found


def violations(edges: dict[tuple[str, str], list[str]], exceptions: dict[tuple[str, str], str]) -> list[str]:
    """Every broken rule, one line per (room edge), with the imports that make it."""
    forbidden = {("ops", target) for target in ("patching", "integrations", "apps", "testing", MEGATRON)}
    forbidden.add(("patching", "integrations"))
    # cross_tokenizer: the ops and torch only (a library any training loop can call)
    forbidden.update(("cross_tokenizer", target) for target in ("patching", "integrations", "inference",
                                                                 "processors", "apps", "testing", MEGATRON))
    # teachers: framework-free, under the integrations (they build on it, never the reverse)
    forbidden.update(("teachers", target) for target in ("patching", "integrations", "processors", "apps",
                                                          "testing", MEGATRON))
    # shared_prefix: the ops and megatron-core only (every framework's host builds on it)
    forbidden.update(("shared_prefix", target) for target in ("patching", "integrations", "inference", "processors",
                                                               "teachers", "apps", "testing"))
    rooms = {name for edge in edges for name in edge}
    # model: a floor below every room that uses it (megatron-core looked up lazily); the ops stay framework-free
    forbidden.update(("model", target) for target in rooms - {"model", "_log", MEGATRON})
    forbidden.add(("ops", "model"))
    forbidden.update((source, target) for source in rooms - LIBRARY_EXEMPT for target in ("apps", "testing"))
    problems = [
        f"{a} must not import {b}: {', '.join(edges[a, b][:3])}"
        for a, b in sorted(edges)
        if (a, b) in forbidden and (a, b) not in exceptions
    ]
    allowed = {edge: why for edge, why in edges.items() if edge not in exceptions}
    problems += [f"import cycle between rooms {' <-> '.join(component)}" for component in cycles(allowed)]
    return problems


# ------------------------------------------------------------------ the package itself


def test_the_package_follows_the_layer_rules():
    assert violations(room_graph(package_graph()), EXCEPTIONS) == []


def test_no_cycle_between_modules_inside_a_room():
    assert module_cycles(module_graph()) == []


def test_an_in_room_cycle_is_found_also_through_functions_and_type_checking(tmp_path):
    """The rule can fail: a synthetic room whose two modules import each other, one of them only
    inside a function and the other only under TYPE_CHECKING."""
    graph = {f"{PACKAGE}.ops.a": {f"{PACKAGE}.ops.b"}, f"{PACKAGE}.ops.b": {f"{PACKAGE}.ops.a"},
             f"{PACKAGE}.ops.c": {f"{PACKAGE}.ops.a"}}
    assert module_cycles(graph) == [[f"{PACKAGE}.ops.a", f"{PACKAGE}.ops.b"]]
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n"
              "def f():\n    from megatron_rl_patches.ops import b\n")
    names = imported_names(ast.parse(source), f"{PACKAGE}.ops.a", is_package=False)
    assert f"{PACKAGE}.ops.b" in names and f"{PACKAGE}.ops.b.B" in names


def test_every_exception_is_still_needed():
    edges = room_graph(package_graph())
    assert [edge for edge in EXCEPTIONS if edge not in edges] == []


def test_function_level_and_relative_imports_are_read():
    tree = ast.parse("def f():\n    from .records import Patch\n    import megatron.core\nfrom . import env\n")
    names = imported_names(tree, f"{PACKAGE}.patching.registry", is_package=False)
    assert {f"{PACKAGE}.patching.records", "megatron.core", f"{PACKAGE}.patching.env"} <= names


def test_every_module_has_a_room():
    assert all(room(module) for module in package_graph())


def test_the_package_top_holds_at_most_eight_files():
    """The public face, reentrant, windows, settings and the package's own machinery (issue 107): a
    helper lives beside the room that uses it, not on the top floor."""
    top = sorted(path.name for path in ROOT.glob("*.py"))
    assert len(top) <= 8, top


# ------------------------------------------------------------------ the checker on synthetic graphs


def synthetic(*pairs: str) -> dict[tuple[str, str], list[str]]:
    """'a.b -> c.d' lines (modules below the package) as a room graph."""
    graph: dict[str, set[str]] = {}
    for pair in pairs:
        source, target = (f"{PACKAGE}.{side.strip()}" for side in pair.split("->"))
        graph.setdefault(source, set()).add(target)
    return room_graph(graph)


def test_a_clean_graph_passes():
    edges = synthetic("integrations.slime -> inference.build", "inference.build -> ops.logprobs",
                      "inference.build -> model.chunks", "model.chunks -> _log", "shared_prefix.plan -> model.kinds",
                      "cli.run -> integrations.slime", "cli.run -> testing.plugin", "ops.topk -> ops.logprobs")
    assert violations(edges, {}) == []


@pytest.mark.parametrize(("pairs", "expected"), [
    (("ops.topk -> patching.env",), "ops must not import patching"),
    (("inference.build -> cli.run",), "inference must not import apps"),
    (("windows -> apps.bench.windows",), "windows must not import apps"),
    (("reentrant -> testing.fake_ddp",), "reentrant must not import testing"),
    (("patching.launcher -> integrations",), "patching must not import integrations"),
    (("teachers.served -> integrations.slime.opd",), "teachers must not import integrations"),
    (("teachers.served -> processors.heads",), "teachers must not import processors"),
    (("model.chunks -> inference.build",), "model must not import inference"),
    (("model.chunks -> settings",), "model must not import settings"),
    (("ops.topk -> model.chunks",), "ops must not import model"),
    (("integrations.slime -> inference.build", "inference.roles -> integrations.slime"),
     "import cycle between rooms inference <-> integrations"),
    (("reentrant -> windows", "windows -> _log", "_log -> reentrant"),
     "import cycle between rooms _log <-> reentrant <-> windows"),
])
def test_a_broken_rule_is_reported(pairs, expected):
    found = violations(synthetic(*pairs), {})
    assert any(line.startswith(expected) for line in found), found


def test_ops_importing_megatron_is_reported():
    edges = room_graph({f"{PACKAGE}.ops.lm_head": {"megatron.core.parallel_state"}})
    assert violations(edges, {}) == [
        f"ops must not import {MEGATRON}: {PACKAGE}.ops.lm_head -> megatron.core.parallel_state"]


def test_an_exception_silences_only_its_own_edge():
    edges = synthetic("inference.build -> cli.run", "inference.build -> demo.loop", "ops.topk -> testing.plugin")
    found = violations(edges, {("inference", "apps"): "issue N item M"})
    assert found == [f"ops must not import testing: {PACKAGE}.ops.topk -> {PACKAGE}.testing.plugin"]


def test_a_room_importing_itself_is_no_cycle():
    assert violations(synthetic("ops.topk -> ops.logprobs", "ops.logprobs -> ops.topk"), {}) == []


def test_a_module_outside_every_room_fails_loudly():
    with pytest.raises(KeyError, match="in no room"):
        room(f"{PACKAGE}.newthing.module")


# The in-process OPD wing on megatron-core (integrations/megatron/opd/, issue 87 item 6; issue 73 item 1
# named it integrations/megatron/teachers/) serves every Megatron host: it names no framework's module
# (slime's own, nor our slime integration); the hosts supply what differs.
TEACHERS_HOME = f"{PACKAGE}.integrations.megatron.opd"
FRAMEWORKS = ("slime", f"{PACKAGE}.integrations.slime")


def framework_imports(imports: dict[str, set[str]]) -> list[str]:
    """`module -> name` for each import of a framework by a module of the teachers' home."""
    return sorted(f"{module} -> {name}" for module, names in imports.items()
                  if module == TEACHERS_HOME or module.startswith(TEACHERS_HOME + ".")
                  for name in names if any(name == f or name.startswith(f + ".") for f in FRAMEWORKS))


def test_the_teachers_home_imports_no_framework():
    files = {module_name(path): path for path in ROOT.rglob("*.py")}
    imports = {module: imported_names(ast.parse(path.read_text(), str(path)), module, path.name == "__init__.py")
               for module, path in files.items()}
    assert any(module.startswith(TEACHERS_HOME + ".") for module in imports)
    assert framework_imports(imports) == []


def test_a_framework_import_in_the_teachers_home_is_reported():
    found = framework_imports({f"{TEACHERS_HOME}.a": {"slime.utils.misc", "torch"},
                               f"{TEACHERS_HOME}.b": {f"{PACKAGE}.integrations.slime.host"},
                               f"{PACKAGE}.integrations.slime.opd": {"slime.utils"}})
    assert found == [f"{TEACHERS_HOME}.a -> slime.utils.misc",
                     f"{TEACHERS_HOME}.b -> {PACKAGE}.integrations.slime.host"]
