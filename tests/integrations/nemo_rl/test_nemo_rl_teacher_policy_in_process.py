"""NeMo-RL's teacher policies of a `Policy` (`teacher_policy`'s skeleton, `PrivilegedTeacherPolicy`,
`StudentPolicyPass`) in one process, beside the refusal files and the NeMo-RL lane
(`lane/test_nemo_rl_self_teacher.py`: NeMo-RL's own driver at TP=1/2): NeMo-RL's `BatchedDataDict`
stood in (a dict), its `Policy` a stand-in whose top-k answer is a function of the ids it is
asked. The privileged batch asked exactly, its rows placed at the student's positions, NeMo-RL's
arguments handed on, the residency calls each role's, the setup block's names and rollouts, every
message matched whole (issue 86 item 17)."""
from __future__ import annotations

import re
import sys
import types

import pytest
import torch

from megatron_rl_patches.integrations.nemo_rl import (
    PrivilegedTeacherPolicy,
    StudentPolicyPass,
    privileged_teacher_in_setup,
    privileged_teacher_policy,
    self_teacher_in_setup,
    self_teacher_policy,
    served_teacher_policy,
)
from megatron_rl_patches.integrations.nemo_rl.privileged_teacher import PRIVILEGED
from megatron_rl_patches.integrations.nemo_rl.self_teacher import SELF
from megatron_rl_patches.integrations.nemo_rl.teacher_policy import teacher_in_setup

K = 2


def whole(text: str) -> str:
    return "^" + re.escape(text) + "$"


class BatchedDataDict(dict):
    """NeMo-RL's BatchedDataDict in little: a dict of tensors."""


@pytest.fixture(autouse=True)
def batched_data_dict(monkeypatch):
    module = types.ModuleType("nemo_rl.distributed.batched_data_dict")
    module.BatchedDataDict = BatchedDataDict  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)


class Scorer:
    """NeMo-RL's `Policy` as the teacher policies call it: the top-k answer at [i, s, j] is
    `ids[i, s] + j` (ids) and `-(ids[i, s] + j) / 10` (logits), width k; every call noted."""

    def __init__(self) -> None:
        self.asked: list[tuple[dict, dict]] = []
        self.moves: list[tuple[str, tuple, dict]] = []

    def get_topk_logits(self, data, k, micro_batch_size=None, timer=None):
        self.asked.append((data, {"k": k, "micro_batch_size": micro_batch_size, "timer": timer}))
        ids = data["input_ids"][..., None] + torch.arange(k)
        return {"topk_logits": -ids.float() / 10, "topk_indices": ids}

    def prepare_for_lp_inference(self, *args, **kwargs):
        self.moves.append(("prepare", args, kwargs))
        return "prepared"

    def offload_after_refit(self, *args, **kwargs):
        self.moves.append(("after", args, kwargs))
        return "after"

    def offload_before_refit(self, *args, **kwargs):
        self.moves.append(("before", args, kwargs))
        return "before"


def student_data(**fields) -> dict:
    """Two samples of NeMo-RL's batch: prompts [5, 6] and [1], responses [7, 8] and [2, 3, 4], padded to 5."""
    return {"input_ids": torch.tensor([[5, 6, 7, 8, 0], [1, 2, 3, 4, 0]]), "input_lengths": torch.tensor([4, 4]),
            "token_mask": torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 1, 0]]), **fields}


@pytest.mark.parametrize("make", [lambda s: privileged_teacher_policy("hint", teacher=s),
                                  lambda s: self_teacher_policy("hint", student=s)])
def test_the_privileged_batch_asked_exactly_and_its_rows_placed_at_the_students_positions(make):
    scorer = Scorer()
    policy = make(scorer)
    data = student_data(hint=[[40, 41, 42], [50]])
    kept = {name: value.clone() for name, value in data.items() if isinstance(value, torch.Tensor)}
    got = policy.get_topk_logits(data, k=K, micro_batch_size=3, timer="timer")
    (asked, arguments), = scorer.asked
    assert type(asked) is BatchedDataDict and type(got) is BatchedDataDict
    assert arguments == {"k": K, "micro_batch_size": 3, "timer": "timer"}
    assert asked["input_ids"].tolist() == [[40, 41, 42, 7, 8], [50, 2, 3, 4, 0]]
    assert asked["input_lengths"].tolist() == [5, 4]
    assert asked["token_mask"].tolist() == [[0, 0, 0, 1, 1], [0, 1, 1, 1, 0]]
    assert set(got) == {"topk_logits", "topk_indices"}
    ids, values = got["topk_indices"], got["topk_logits"]
    assert ids.shape == (2, 5, K) and ids.dtype == torch.int64 and values.dtype == torch.float32
    # sample 0's rows 1, 2 (predicting 7, 8) are the teacher's at 2, 3 (after its context 40 41 42)
    assert ids[0, 1:3].tolist() == [[42, 43], [7, 8]] and ids[1, 0:3].tolist() == [[50, 51], [2, 3], [3, 4]]
    assert torch.equal(values[0, 1:3], -ids[0, 1:3].float() / 10)
    filler = [[0, 1]]  # rows no loss reads: ids 0 .. k-1 at log(1 / (k + 1))
    assert ids[0, [0, 3, 4]].tolist() == filler * 3 and ids[1, 3:].tolist() == filler * 2
    assert torch.allclose(values[1, 3:], torch.full((2, K), -torch.log(torch.tensor(3.0)).item()))
    assert all(torch.equal(kept[name], data[name]) for name in kept) and data["hint"] == [[40, 41, 42], [50]]


def test_the_last_rollouts_contexts_read_once_where_the_batch_has_no_field():
    scorer = Scorer()
    policy = self_teacher_policy("hint", student=scorer)
    policy.rollout_values = [[40], [50, 51]]
    policy.get_topk_logits(student_data(), k=K)
    assert scorer.asked[0][0]["input_ids"].tolist() == [[40, 7, 8, 0, 0], [50, 51, 2, 3, 4]]
    assert policy.rollout_values is None
    policy.rollout_values = [[60], [70]]
    policy.get_topk_logits(student_data(hint=[[40], [50]]), k=K)  # the batch's field first
    assert scorer.asked[1][0]["input_ids"][:, 0].tolist() == [40, 50] and policy.rollout_values is None
    with pytest.raises(ValueError, match=whole(
            "StudentPolicyPass.get_topk_logits(data): the teacher has context='hint' and neither this batch (it has "
            "['input_ids', 'input_lengths', 'token_mask']) nor a rollout seen by self_teacher_in_setup(policy) holds "
            "the field: run distillation_train inside the self_teacher_in_setup(policy) block (its rollouts read "
            "each sample's field 'hint' or extra_env_info['hint'])")):
        policy.get_topk_logits(student_data(), k=K)


def test_a_batch_without_nemo_rls_fields_refused_whole_naming_the_policys_call():
    with pytest.raises(ValueError, match=whole(
            "StudentPolicyPass.get_topk_logits(data): data has no 'input_lengths' (NeMo-RL's distillation batch holds "
            "input_ids, input_lengths, token_mask)")):
        self_teacher_policy("hint", student=Scorer()).get_topk_logits({"input_ids": torch.zeros(2, 3)}, k=K)


def test_an_answer_of_another_shape_refused_whole_naming_whose_pass():
    class Short(Scorer):
        def get_topk_logits(self, data, k, micro_batch_size=None, timer=None):
            return {"topk_logits": torch.zeros(2, 3, k), "topk_indices": torch.zeros(2, 3, k, dtype=torch.long)}

    with pytest.raises(ValueError, match=whole(
            "PrivilegedTeacherPolicy.get_topk_logits(data): the teacher's get_topk_logits answered topk_logits "
            "(2, 3, 2) for a privileged batch of 2 samples and k=2: expected [B, S', k]")):
        privileged_teacher_policy("hint", teacher=Short()).get_topk_logits(student_data(hint=[[9], [9]]), k=K)


def test_each_roles_residency_calls():
    teacher, student = Scorer(), Scorer()
    privileged = privileged_teacher_policy("hint", teacher=teacher)
    assert privileged.prepare_for_lp_inference(1, a=2) == "prepared"
    assert privileged.offload_after_refit(3, b=4) == "after" and privileged.offload_before_refit(6, c=7) == "before"
    assert teacher.moves == [("prepare", (1,), {"a": 2}), ("after", (3,), {"b": 4}), ("before", (6,), {"c": 7})]
    live = self_teacher_policy("hint", student=student)
    assert live.prepare_for_lp_inference(5) == "prepared"
    assert live.offload_after_refit() is None and live.offload_before_refit() is None  # the student trains next
    assert student.moves == [("prepare", (5,), {})]
    assert privileged.teacher is teacher and live.student is student
    assert repr(privileged) == "PrivilegedTeacherPolicy(context='hint')"
    served = served_teacher_policy("http://127.0.0.1:9")  # the discard port: residency asks the server nothing
    assert served.prepare_for_lp_inference(1) is None and served.offload_after_refit() is None
    assert served.offload_before_refit() is None
    assert repr(live) == "StudentPolicyPass(context='hint')"


def test_the_refusals_matched_whole():
    with pytest.raises(ValueError, match=whole(
            "PrivilegedTeacherPolicy(context=None): without a privileged context this is NeMo-RL's own teacher: use "
            "its Policy as it is, or give the batch field of each sample's context, e.g. "
            "privileged_teacher_policy(context='solution')")):
        PrivilegedTeacherPolicy(None)
    with pytest.raises(ValueError, match=whole(
            "PrivilegedTeacherPolicy(context=...): the key of each sample's privileged context must be a non-empty "
            "str or None, got ''")):
        PrivilegedTeacherPolicy("")
    with pytest.raises(ValueError, match=whole(
            "StudentPolicyPass(context=None): the live self-teacher without a privileged context would be the student "
            "scoring itself (every divergence zero); give it the batch field of each sample's context, e.g. "
            "self_teacher_policy(context='solution')")):
        StudentPolicyPass(None)
    with pytest.raises(TypeError, match=whole(
            "PrivilegedTeacherPolicy(teacher=...) must be NeMo-RL's teacher Policy (with get_topk_logits), got "
            "object")):
        privileged_teacher_policy("hint", teacher=object())
    with pytest.raises(TypeError, match=whole(
            "StudentPolicyPass(student=...) must be NeMo-RL's student Policy (with get_topk_logits), got int")):
        self_teacher_policy("hint", student=3)
    with pytest.raises(RuntimeError, match=whole(
            "PrivilegedTeacherPolicy: no teacher policy yet: call NeMo-RL's setup() inside "
            "privileged_teacher_in_setup(policy) (it hands over the teacher Policy setup() builds) or pass "
            "PrivilegedTeacherPolicy(..., teacher=policy)")):
        privileged_teacher_policy("hint").prepare_for_lp_inference()
    with pytest.raises(RuntimeError, match=whole(
            "StudentPolicyPass: no student policy yet: build it inside self_teacher_in_setup(policy) (NeMo-RL's "
            "distillation.setup() hands it the student's Policy) or pass StudentPolicyPass(..., student=policy)")):
        self_teacher_policy("hint").prepare_for_lp_inference()
    with pytest.raises(TypeError, match=whole(
            "privileged_teacher_in_setup(policy=...) takes a PrivilegedTeacherPolicy "
            "(privileged_teacher_policy(context=KEY)), got StudentPolicyPass")):
        privileged_teacher_in_setup(self_teacher_policy("hint")).__enter__()
    with pytest.raises(TypeError, match=whole(
            "self_teacher_in_setup(policy=...) takes a StudentPolicyPass (self_teacher_policy(context=KEY)), got str")):
        self_teacher_in_setup("hint").__enter__()
    with pytest.raises(TypeError, match=whole("teacher_in_setup(policy=...) takes a TeacherPolicy, got NoneType")):
        teacher_in_setup(None).__enter__()


def test_the_setup_block_answers_nemo_rls_names_and_keeps_each_rollouts_contexts():
    built = []

    def policy_class(*args, **kwargs):
        built.append((args, kwargs))
        return Scorer()

    def run_multi_turn_rollout(*args, **kwargs):
        return ("rolled", args, kwargs)

    module = types.SimpleNamespace(Policy=policy_class, run_multi_turn_rollout=run_multi_turn_rollout)
    policy = privileged_teacher_policy("hint")
    with privileged_teacher_in_setup(policy, module=module) as entered:
        assert entered is policy
        assert module.Policy(1, name_prefix="teacher", x=2) is policy
        student = module.Policy(3, name_prefix="policy")
        batch = {"hint": [[1], [2, 3]]}
        assert module.run_multi_turn_rollout(4, input_batch=batch) == ("rolled", (4,), {"input_batch": batch})
    assert built == [((1,), {"name_prefix": "teacher", "x": 2}), ((3,), {"name_prefix": "policy"})]
    assert isinstance(policy.teacher, Scorer) and policy.teacher is not student
    assert policy.rollout_values == [[1], [2, 3]]
    assert module.Policy is policy_class and module.run_multi_turn_rollout is run_multi_turn_rollout
    assert not hasattr(module, "run_async_multi_turn_rollout")  # a name the module lacks: left absent
    live = self_teacher_policy("hint")
    module = types.SimpleNamespace(Policy=policy_class)
    with teacher_in_setup(live, module=module, role=SELF):
        assert module.Policy(name_prefix="teacher") is live and live.student is None
        mine = module.Policy(name_prefix="policy")
    assert live.student is mine and len(built) == 3
    assert PRIVILEGED.where == "PrivilegedTeacherPolicy.get_topk_logits(data)"


def test_a_block_left_by_an_error_restores_nemo_rls_names():
    def policy_class(*args, **kwargs):
        return Scorer()

    def run_multi_turn_rollout(*args, **kwargs):
        return None

    module = types.SimpleNamespace(Policy=policy_class, run_multi_turn_rollout=run_multi_turn_rollout)
    with pytest.raises(KeyError):
        with self_teacher_in_setup(self_teacher_policy("hint"), module=module):
            raise KeyError("setup failed")
    assert module.Policy is policy_class and module.run_multi_turn_rollout is run_multi_turn_rollout


@pytest.mark.parametrize("make", [privileged_teacher_policy, self_teacher_policy])
def test_text_contexts_read_in_the_policys_tokenizer_its_vocabulary_bounding_the_ids(make, tmp_path):
    from megatron_rl_patches.testing.hf_checkpoints import save_word_tokenizer

    save_word_tokenizer(tmp_path, 48)  # "tN" is id N
    scorer = Scorer()
    role = "teacher" if make is privileged_teacher_policy else "student"
    policy = make("hint", tokenizer=str(tmp_path), **{role: scorer})
    policy.get_topk_logits(student_data(hint=["t40 t41 t42", "t47"]), k=K)
    assert scorer.asked[0][0]["input_ids"].tolist() == [[40, 41, 42, 7, 8], [47, 2, 3, 4, 0]]
    name = type(policy).__name__
    with pytest.raises(ValueError, match=whole(f"{name}.get_topk_logits(data): sample 1's context under 'hint' holds "
                                               "id 48, past the teacher's vocabulary of 48: tokenize it with the "
                                               "teacher's tokenizer")):
        policy.get_topk_logits(student_data(hint=[[1], [48]]), k=K)
