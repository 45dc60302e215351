"""`served_teacher_in_setup` and `privileged_teacher_in_setup` against NeMo-RL 7ea279ab's own
`distillation.setup()` source: the lane cannot import distillation.py (it needs torchdata,
datasets, Ray and vLLM generation), so its `Policy(...)` calls are read from the source and each
is made, with its own keywords' names, on a module whose `Policy` records what it builds: the
teacher's is the served policy (or NeMo-RL's own inside the privileged wrapper), the student's
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


def test_setups_teacher_policy_is_nemo_rls_own_inside_the_privileged_wrapper():
    from megatron_rl_patches.integrations.nemo_rl import privileged_teacher_in_setup, privileged_teacher_policy

    prefixes = _setup_policy_prefixes()
    built = {}
    module = types.ModuleType("distillation")

    def nemo_rls_policy(**kwargs):
        built[kwargs["name_prefix"]] = made = types.SimpleNamespace(get_topk_logits=lambda *a, **k: None)
        return made

    module.Policy = nemo_rls_policy  # type: ignore[attr-defined]
    policy = privileged_teacher_policy("solution")
    with privileged_teacher_in_setup(policy, module):
        made = {prefix: module.Policy(name_prefix=prefix) for prefix in prefixes}
    assert made["teacher"] is policy and policy.teacher is built["teacher"]
    assert made["student"] is built["student"] and module.Policy is nemo_rls_policy


def test_a_full_vocabulary_policy_makes_setups_loss_the_whole_vocabulary_one_and_restores_it(tmp_path):
    """Within the block `DistillationLossFn(cfg)` (setup()'s loss) is the whole-vocabulary loss on
    the teacher head's directory at the served teacher's temperature; NeMo-RL's class after it.
    Called outside the package's fused step it refuses by name (NeMo-RL's own path would hand it
    top-k logits)."""
    import torch

    from megatron_rl_patches.integrations.nemo_rl import served_teacher_in_setup, served_teacher_policy
    from megatron_rl_patches.integrations.nemo_rl.vocab_kd import WholeVocabularyDistillationLossFn
    from megatron_rl_patches.teachers.head.teacher_head import TeacherHead

    head = TeacherHead(torch.zeros(8, 4), 8, 8, 0, source=str(tmp_path))
    policy = served_teacher_policy("http://127.0.0.1:9", top_k=4, head=head, temperature=0.7, full_vocabulary=True)
    module = types.ModuleType("distillation")
    module.Policy = lambda **kwargs: object()  # type: ignore[attr-defined]
    module.DistillationLossFn = nemo_rls_loss = object()  # type: ignore[attr-defined]
    with served_teacher_in_setup(policy, module):
        loss = module.DistillationLossFn({"kl_type": "mixed", "mixed_kl_weight": 0.25, "zero_outside_topk": False})
    assert module.DistillationLossFn is nemo_rls_loss
    assert isinstance(loss, WholeVocabularyDistillationLossFn)
    assert (loss.head, loss.temperature, loss.divergence) == (str(tmp_path), 0.7, ("mixed_kl", 0.75))
    with pytest.raises(RuntimeError, match="apply megatron_rl_patches' nemo_rl_topk_kd"):
        loss(data={}, global_valid_toks=None, student_topk_logprobs=None)
    with pytest.raises(ValueError, match=r"kl_type must be one of"):
        WholeVocabularyDistillationLossFn({"kl_type": "jsd"}, head=str(tmp_path))
