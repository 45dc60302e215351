"""slime's privileged contexts (`integrations.slime.contexts`) in one process, beside
`test_slime_contexts.py`: the wrappers called as slime may call them (keywords, no data), a rollout
without train_metadata, slime's own `metadata` read where no split carried the contexts, and the
refusals matched whole (issue 86 item 17: the survivors of its mutation row)."""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from megatron_rl_patches.integrations.megatron.opd.opd_settings import opd_settings
from megatron_rl_patches.integrations.megatron.opd.step_contexts import step_contexts
from megatron_rl_patches.integrations.megatron.opd.topk_request import CONTEXTS
from megatron_rl_patches.integrations.slime import contexts

TEACHERS = "MEGATRON_RL_PATCHES_OPD_TEACHERS"
ENV = {TEACHERS: "http://127.0.0.1:9;engine=vllm;context=hint", "MEGATRON_RL_PATCHES_OPD_IDS_FROM": "teacher"}


def whole(text: str) -> str:
    return "^" + re.escape(text) + "$"


def test_a_rollout_without_train_metadata_carries_nothing_for_each_sample():
    assert contexts.carried({"tokens": [[1], [2, 3]]}, ["hint"]) == [{}, {}]
    assert contexts.carried({"tokens": [[1]], "metadata": None}, ["hint"]) == [{}]


def test_the_wrappers_take_slimes_data_by_keyword_and_hand_it_on_so(monkeypatch):
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    data = {"tokens": [[1, 2], [3]], "metadata": [{"hint": [7]}, {"hint": "b"}]}
    seen = []

    def tensorize(*, rollout_data):
        seen.append(dict(rollout_data))
        return "tensorized"

    def split(*, data):
        rank = {"tokens": list(data["tokens"])}
        return contexts.tensorize_wrapper(tensorize, None, (), {"rollout_data": rank})

    assert contexts.split_wrapper(split, None, (), {"data": data}) == "tensorized"
    assert seen == [{"tokens": [[1, 2], [3]], CONTEXTS: [{"hint": [7]}, {"hint": "b"}]}]
    assert data["tokens"] == [[1, 2], [3]]


def test_the_wrappers_hand_slime_what_they_cannot_read_untouched(monkeypatch):
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    calls = []

    def wrapped(*args, **kwargs):
        calls.append((args, kwargs))
        return "slime's"

    no_tokens = {"metadata": [{"hint": [1]}]}
    assert contexts.split_wrapper(wrapped, None, (no_tokens,), {}) == "slime's"
    assert contexts.split_wrapper(wrapped, None, (None,), {}) == "slime's"
    assert contexts.tensorize_wrapper(wrapped, None, (), {}) == "slime's"  # no rollout data: slime's own call
    assert calls == [((no_tokens,), {}), ((None,), {}), ((), {})]
    assert no_tokens == {"metadata": [{"hint": [1]}]}


def test_slimes_own_metadata_read_where_no_split_carried_the_contexts():
    data = {"tokens": [torch.arange(3)] * 2, "response_lengths": [2, 2], "metadata": [{"hint": [3, 4]}, {"hint": [5]}]}
    got = step_contexts(None, data, opd_settings(ENV))
    assert [one["hint"].tolist() for one in got] == [[3, 4], [5]]


def test_a_context_of_another_kind_refused_whole_with_slimes_name():
    data = {"tokens": [torch.arange(3)], "response_lengths": [2], CONTEXTS: [{"hint": 3.5}]}
    with pytest.raises(TypeError, match=whole(
            "slime_opd: sample 0's train_metadata['hint'] must be text or token ids (a 1-D integer list, array or "
            "tensor), got float")):
        step_contexts(None, data, opd_settings(ENV))


def test_the_allgather_cp_refusal_matched_whole():
    settings = opd_settings({TEACHERS: "/ckpt/teacher;tokenizer=own;context=hint"})
    with pytest.raises(ValueError, match=whole(
            "MEGATRON_RL_PATCHES_OPD_TEACHERS: teacher(s) ['/ckpt/teacher'] with ';context=KEY' of another tokenizer "
            "or at their own layout run under --allgather-cp at --context-parallel-size 2, which slime's OPD does not "
            "score them at yet: drop --allgather-cp (megatron-core's zigzag context parallelism takes them), or give "
            "the teacher the student's tokenizer and layout")):
        contexts.check_layouts(SimpleNamespace(allgather_cp=True, context_parallel_size=2), settings)


@pytest.fixture
def one_rank_world():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_missing_context_agreed_over_the_job_says_what_failed_where(one_rank_world):
    data = {"tokens": [torch.arange(3)], "response_lengths": [2], CONTEXTS: [{"other": [1]}]}
    with pytest.raises(ValueError, match=whole(
            "slime_opd: the privileged contexts failed on rank 0: ValueError: slime_opd: sample 0 (rollout index) has "
            "no train_metadata['hint'] for the teacher(s) ['http://127.0.0.1:9'] with ';context=hint' (its "
            "train_metadata holds ['other']): fill it for every sample in the rollout's generate function")):
        step_contexts(None, data, opd_settings(ENV))
