"""`served_teacher_in_setup` against NeMo-RL 7ea279ab's own `distillation.setup()` source: the lane
cannot import distillation.py (it needs torchdata, datasets, Ray and vLLM generation), so its
`Policy(...)` calls are read from the source and each is made, with its own keywords' names, on a
module whose `Policy` records what it builds: the teacher's is the served policy, the student's
NeMo-RL's own."""
from __future__ import annotations

import ast
import importlib.util
import os
import types

import pytest

pytest.importorskip("nemo_rl", reason="NeMo-RL's source is not on the path: run `make test-nemo NEMO_RL=...`")
pytestmark = pytest.mark.nemo_rl


def _setup_policy_prefixes() -> list[str]:
    spec = importlib.util.find_spec("nemo_rl")
    assert spec is not None and spec.submodule_search_locations is not None
    path = os.path.join(list(spec.submodule_search_locations)[0], "algorithms", "distillation.py")
    with open(path, encoding="utf-8") as source:
        tree = ast.parse(source.read())
    setup = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "setup")
    prefixes = []
    for node in ast.walk(setup):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Policy":
            keywords = {kw.arg: kw.value for kw in node.keywords}
            prefixes.append(ast.literal_eval(keywords["name_prefix"]))
    return prefixes


def test_setups_teacher_policy_is_the_served_one_and_the_students_nemo_rls():
    from megatron_rl_patches.integrations.nemo_rl import served_teacher_in_setup, served_teacher_policy

    prefixes = _setup_policy_prefixes()
    assert sorted(prefixes) == ["student", "teacher"]  # what 7ea279ab's setup() builds
    built = []
    module = types.ModuleType("distillation")
    def nemo_rls_policy(**kwargs):
        built.append(kwargs["name_prefix"])
        return object()

    module.Policy = nemo_rls_policy  # type: ignore[attr-defined]
    policy = served_teacher_policy("http://127.0.0.1:9")
    with served_teacher_in_setup(policy, module):
        made = {prefix: module.Policy(name_prefix=prefix) for prefix in prefixes}
    assert made["teacher"] is policy and made["student"] is not policy and built == ["student"]
