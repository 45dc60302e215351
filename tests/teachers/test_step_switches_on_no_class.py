"""The teacher step and the served client tell teachers, engines and pools apart by protocol
(`asynchronous.AsyncTeacher`, `served.endpoint`), never by a class of the package's: no
`isinstance(x, ServedTeacher)`, engine or pool class in their modules (issue 87)."""
from __future__ import annotations

import ast
from pathlib import Path

TEACHERS = Path(__file__).parents[2] / "megatron_rl_patches" / "teachers"
CONCRETE = {"ServedTeacher", "VllmEngine", "VllmPoolingEngine", "ReplicaPool", "Server", "SelfTeacher"}


def concrete_checks(source: str, name: str) -> list[str]:
    """`isinstance` calls of `source` whose class (or one of a tuple of them) is a concrete teacher,
    engine or pool class of the package's."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance" \
                and len(node.args) == 2:
            kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            found += [f"{name}:{node.lineno} {k.id}" for k in kinds if isinstance(k, ast.Name) and k.id in CONCRETE]
    return found


def test_the_step_and_the_client_switch_on_no_class():
    modules = sorted(TEACHERS.glob("step/*.py")) + [TEACHERS / "served" / "client.py"]
    assert len(modules) >= 7
    found = [hit for path in modules for hit in concrete_checks(path.read_text(), path.name)]
    assert found == []


def test_the_check_finds_a_switch_on_a_class():
    assert concrete_checks("if isinstance(t, (int, ServedTeacher)): pass\nisinstance(e, VllmPoolingEngine)\n",
                           "x.py") == ["x.py:1 ServedTeacher", "x.py:2 VllmPoolingEngine"]
