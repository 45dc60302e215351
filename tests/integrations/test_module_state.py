"""No hidden channel in the frameworks' integrations (issue 87 item 5): state is passed as arguments
or held by an object the framework's own object owns (verl's teacher client and engine, slime's
rollout data), never through module or context state. Read on the source with `ast`: every
module-level name of `integrations/` bound to a ContextVar, to a container the module then changes
(a cache: `NAME[key] = ...`, `NAME.add(...)`, ...), to an instance of a class of its own module (a
singleton holding state), or rebound through `global`, must be listed in `ALLOWED` with why it may
stay; a new one fails here until it is moved onto an owner or listed. The checker is tested on
small synthetic modules too, so a rule that can no longer fail shows."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import megatron_rl_patches

ROOT = Path(megatron_rl_patches.__file__).resolve().parent / "integrations"
MUTATORS = {"add", "append", "clear", "discard", "extend", "insert", "pop", "popitem", "remove", "setdefault",
            "update", "__setitem__", "__delitem__"}
CONTAINERS = {"dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "deque", "WeakKeyDictionary",
              "WeakValueDictionary", "WeakSet"}

# (module under integrations/, name) -> why it may stay
ALLOWED = {
    ("verl/rows.py", "_PENDING"): "verl's data seam (session 10): the rows verl reads, noted by the engine's "
                                  "forward_step for the fused processor its own model forward calls (docs/design.md)",
    ("verl/rows.py", "_PACKED"): "verl's data seam (session 10): the packed row mask, from verl's label packing to "
                                 "the same forward's processor (docs/design.md)",
    ("verl/fused.py", "_CALCULATE_ENTROPY"): "verl's data seam (session 10): calculate_entropy from verl's fused "
                                             "engine factory to its processor (docs/design.md)",
    ("_ray.py", "_state"): "whether the Ray hook is armed and installed: one process-wide switch, not data",
    ("__init__.py", "_default"): "the default patch registry, one per process",
    ("student_head.py", "_HEADS"): "a served teacher's head read once per process per layout (weights, not a "
                                   "step's data; NeMo-RL's loss and verl's step both build it where no framework "
                                   "object lives that long)",
}


def module_state(tree: ast.Module) -> set[str]:
    """The module-level names of `tree` that hold state: a ContextVar, a container the module changes,
    an instance of a class of its own, or a name rebound through `global`."""
    own_classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    bound: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    bound[target.id] = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            bound[node.target.id] = node.value
    changed, rebound = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            rebound.update(node.names)
        elif isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(node.ctx, (ast.Store, ast.Del)) \
                and isinstance(node.value, ast.Name):
            changed.add(node.value.id)
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            changed.add(node.target.id)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS \
                and isinstance(node.func.value, ast.Name):
            changed.add(node.func.value.id)
    found = set(rebound)
    for name, value in bound.items():
        called = value.func if isinstance(value, ast.Call) else None
        callee = called.attr if isinstance(called, ast.Attribute) else called.id if isinstance(called, ast.Name) else ""
        container = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) \
            or callee in CONTAINERS
        if callee == "ContextVar" or (container and name in changed) or callee in own_classes:
            found.add(name)
    return found


def integration_state() -> set[tuple[str, str]]:
    return {(path.relative_to(ROOT).as_posix(), name) for path in sorted(ROOT.rglob("*.py"))
            for name in module_state(ast.parse(path.read_text(), str(path)))}


def test_no_integration_holds_state_in_a_module_beyond_the_listed_ones():
    found = integration_state()
    unlisted = sorted(found - set(ALLOWED))
    assert not unlisted, (f"module-level state in integrations/ {unlisted}: pass it as an argument or hold it on "
                          "the framework's own object (e.g. integrations/verl/held.py), or list it in ALLOWED with "
                          "why it may stay")
    assert not sorted(set(ALLOWED) - found), "ALLOWED lists state that is gone: drop its row"


@pytest.mark.parametrize(("source", "expected"), [
    ("import contextvars\nSAMPLE = contextvars.ContextVar('s', default=None)", {"SAMPLE"}),
    ("from contextvars import ContextVar\nX: ContextVar[int] = ContextVar('x')", {"X"}),
    ("_TEACHERS = {}\ndef get(k):\n    _TEACHERS[k] = 1", {"_TEACHERS"}),
    ("SEEN: set[str] = set()\ndef see(k):\n    SEEN.add(k)", {"SEEN"}),
    ("class OldRows:\n    pass\nOLD_ROWS = OldRows()", {"OLD_ROWS"}),
    ("_default = None\ndef registry():\n    global _default\n    _default = 1", {"_default"}),
    ("TABLE = {'a': 1}\ndef get(k):\n    return TABLE[k]", set()),  # a constant table, read only
    ("import threading\n_LOCK = threading.Lock()", set()),
    ("def f():\n    cache = {}\n    cache[1] = 2", set()),  # a function's own container
])
def test_the_checker_finds_module_state_and_nothing_else(source, expected):
    assert module_state(ast.parse(source)) == expected
