"""Multi-rank code agrees before its first collective, by construction (CONTEXT.md section 17; issue
63 item 5), checked on the source with `ast`:

- no vocabulary op with a tensor-parallel group resolves the invariant mode on its own: every one
  goes through `invariance.agreed_invariant` (or `resolve_for_vocab(..., tp_group)`, which calls it),
  so a setting on one rank only is one error on every rank, never two sets of collectives;
- every public teacher-layout scoring function calls `entry.enter` (the checks and the one agreement
  over the replica) before anything else, or is a thin call of one that does;
- the group lookup and the layout build agree (`agreement.agree`) before the group creation.

The checkers are tested on small synthetic sources too, so a rule that can no longer fail shows."""
from __future__ import annotations

import ast
from pathlib import Path

import megatron_rl_patches

ROOT = Path(megatron_rl_patches.__file__).resolve().parent
SCORING = ROOT / "inference" / "teacher_layout" / "scoring.py"


def _calls(node: ast.AST) -> list[str]:
    """The names of the functions called anywhere in `node` (`a.b(...)` gives "b")."""
    names = []
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            func = call.func
            names.append(func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", ""))
    return names


def unagreed_modes(source: str) -> list[str]:
    """Functions that take a `tp_group` and call resolve_invariant, or resolve_for_vocab without it."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef) or "tp_group" not in {a.arg for a in node.args.kwonlyargs
                                                                       + node.args.args}:
            continue
        for call in ast.walk(node):
            if not isinstance(call, ast.Call):
                continue
            name = getattr(call.func, "id", getattr(call.func, "attr", ""))
            if name == "resolve_invariant" or (name == "resolve_for_vocab" and len(call.args) + len(call.keywords) < 4):
                found.append(node.name)
    return found


def first_step(function: ast.FunctionDef) -> str:
    """The first call of `function`'s body that is not a nested definition, a docstring or a plain
    dict / name assignment: "enter" for an entry point that agrees first."""
    for statement in function.body:
        if isinstance(statement, (ast.FunctionDef, ast.Expr)) and not _calls(statement):
            continue
        if isinstance(statement, ast.FunctionDef):
            continue
        calls = _calls(statement)
        if calls:
            return calls[-1] if "enter" not in calls else "enter"
    return ""


def test_the_checker_finds_a_mode_resolved_beside_a_group():
    assert unagreed_modes("def op(x, *, tp_group=None, invariant=None):\n    m = resolve_invariant(invariant)\n") \
        == ["op"]
    assert unagreed_modes("def op(x, *, tp_group=None):\n    m = resolve_for_vocab(i, v, 'op')\n") == ["op"]
    assert unagreed_modes("def op(x, *, tp_group=None):\n    m = agreed_invariant(i, 'op', tp_group)\n") == []
    assert unagreed_modes("def kl(x, *, invariant=None):\n    m = resolve_invariant(invariant)\n") == []


def test_no_vocabulary_op_resolves_the_invariant_mode_without_its_group():
    found = {path.name: unagreed_modes(path.read_text()) for path in (ROOT / "ops").rglob("*.py")}
    assert {name: functions for name, functions in found.items() if functions} == {}


def test_the_checker_finds_an_entry_point_that_does_not_agree_first():
    tree = ast.parse("def f(chunks, tokens):\n    '''doc'''\n    g = chunks[0].teacher_groups\n    gathered(g)\n"
                     "def h(chunks, tokens):\n    def checks(m):\n        raise ValueError\n"
                     "    call = enter('h', chunks, None, tokens, {})\n    gathered(call)\n")
    steps = [first_step(node) for node in tree.body if isinstance(node, ast.FunctionDef)]
    assert steps == ["gathered", "enter"]


def test_every_teacher_layout_scoring_entry_point_agrees_before_anything_else():
    tree = ast.parse(SCORING.read_text())
    public = [node for node in tree.body if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")]
    steps = {node.name: first_step(node) for node in public}
    assert len(public) >= 6, steps
    delegates = {"score_at_layout": "score_with_entropy_at_layout"}  # a thin call of an entry point that agrees
    assert {name: step for name, step in steps.items() if step != "enter" and delegates.get(name) != step} == {}


def test_the_group_lookup_and_the_layout_build_agree_before_the_group_creation():
    groups = ast.parse((ROOT / "inference" / "teacher_layout" / "groups.py").read_text())
    lookup = next(n for n in groups.body if isinstance(n, ast.FunctionDef) and n.name == "teacher_groups")
    calls = _calls(lookup)
    assert calls.index("agree") < calls.index("groups_of_agreed"), calls
    build = ast.parse((ROOT / "inference" / "build_hf.py").read_text())
    agreed = next(n for n in build.body if isinstance(n, ast.FunctionDef) and n.name == "_agreed_layout_build")
    calls = _calls(agreed)
    assert calls.index("agree") < calls.index("_build_at_layout"), calls
    at_layout = next(n for n in build.body if isinstance(n, ast.FunctionDef) and n.name == "_build_at_layout")
    assert "teacher_groups" not in _calls(at_layout)  # groups_of_agreed: created once the build's arguments agree
