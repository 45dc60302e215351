"""slime's micro-batch doors (`integrations/slime/micro_batches.py`) called as wrapt calls them, each
argument by position or by keyword, slime's own function a recording stand-in (in one process, no
slime; the doors against slime's real rollout manager: lane/test_slime_micro_batches_lane.py): what
each door hands slime, and where it packs by the tokens computed instead."""
from __future__ import annotations

import types

import pytest

from megatron_rl_patches.integrations.slime import micro_batches as doors
from megatron_rl_patches.integrations.slime.fused_step import held_settings

SHARED = "MEGATRON_RL_PATCHES_SHARED_PREFIX"
PROMPT = list(range(100, 110))
TOKENS = [PROMPT + [1, 2], PROMPT + [3, 4], [7, 8, 9]]  # two samples sharing 10 tokens, one alone


def recorder(answer="slime's"):
    """slime's function stood in: records each call's (args, kwargs) and answers `answer`."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append((args, kwargs))
        return answer

    return wrapped, calls


def split_recorder():
    """slime's split stood in: records the type of the rollout ids it is handed (the door puts `data`'s
    own list back after the call) and the keywords."""
    calls = []

    def split(*args, **kwargs):
        data = kwargs["data"] if "data" in kwargs else args[0]
        calls.append((type(data["rollout_ids"]), {k: v for k, v in kwargs.items() if k != "data"}))

    return split, calls


def test_the_split_hands_slime_the_rollout_ids_holding_the_tokens_by_keyword_too(monkeypatch):
    monkeypatch.setenv(SHARED, "1")
    seen = []
    data = {"tokens": TOKENS, "rollout_ids": [5, 6, 7]}

    def split(*args, **kwargs):
        ids = kwargs["data"]["rollout_ids"]
        seen.append((type(ids), list(ids), ids.tokens, kwargs["extra"]))
        return "batches"

    manager = types.SimpleNamespace(args=types.SimpleNamespace())
    assert doors.split_wrapper(split, manager, (), {"data": data, "extra": 1}) == "batches"
    assert seen == [(doors.RolloutIds, [5, 6, 7], TOKENS, 1)] and data["rollout_ids"] == [5, 6, 7]
    wrapped, calls = split_recorder()  # a manager without args: the setting read for this call
    doors.split_wrapper(wrapped, object(), (data,), {"extra": 2})
    assert calls == [(doors.RolloutIds, {"extra": 2})]


def test_the_split_reads_the_setting_slimes_args_hold(monkeypatch):
    """Read at the first door and held by slime's args: the same answer after the environment changes."""
    manager = types.SimpleNamespace(args=types.SimpleNamespace())
    monkeypatch.setenv(SHARED, "1")
    assert held_settings(manager.args).shared_prefix
    monkeypatch.setenv(SHARED, "0")
    wrapped, calls = split_recorder()
    doors.split_wrapper(wrapped, manager, ({"tokens": TOKENS, "rollout_ids": [0, 1, 2]},), {})
    assert calls == [(doors.RolloutIds, {})]


@pytest.mark.parametrize("data", [{"tokens": TOKENS}, {"rollout_ids": [0, 1, 2]}, ("tokens", "rollout_ids"), None],
                         ids=["no-rollout-ids", "no-tokens", "no-mapping", "none"])
def test_a_split_without_both_keys_goes_to_slime_as_given(monkeypatch, data):
    monkeypatch.setenv(SHARED, "1")
    wrapped, calls = recorder()
    manager = types.SimpleNamespace(args=types.SimpleNamespace())
    assert doors.split_wrapper(wrapped, manager, (data,), {"extra": 3}) == "slime's"
    assert calls == [((data,), {"extra": 3})]
    monkeypatch.setenv(SHARED, "0")
    off = types.SimpleNamespace(args=types.SimpleNamespace())
    doors.split_wrapper(wrapped, off, (), {"data": {"tokens": TOKENS, "rollout_ids": [0]}, "extra": 4})
    assert calls[1][1]["extra"] == 4 and type(calls[1][1]["data"]["rollout_ids"]) is list


def test_the_schedule_hands_on_lengths_that_know_their_tokens_by_position_and_by_keyword():
    ids = doors.RolloutIds([0, 1, 2], TOKENS)
    wrapped, calls = recorder()
    doors.schedule_wrapper(wrapped, None, ("args", "config", [12, 12, 3], "fourth"), {"rollout_indices": ids})
    (args, kwargs), = calls
    assert args[:2] == ("args", "config") and args[3:] == ("fourth",) and kwargs == {"rollout_indices": ids}
    assert [(int(n), n.index, n.tokens) for n in args[2]] == [(12, 0, TOKENS), (12, 1, TOKENS), (3, 2, TOKENS)]
    doors.schedule_wrapper(wrapped, None, ("args", "config"), {"total_lengths": [12, 12, 3], "rollout_indices": ids,
                                                               "global_batch_size": 8})
    args, kwargs = calls[1]
    assert args == ("args", "config") and kwargs["global_batch_size"] == 8 and kwargs["rollout_indices"] is ids
    assert all(isinstance(n, doors.SampleLength) for n in kwargs["total_lengths"])
    assert [n.index for n in kwargs["total_lengths"]] == [0, 1, 2]


def test_lengths_of_another_count_than_the_tokens_go_to_slime_as_given():
    wrapped, calls = recorder()
    doors.schedule_wrapper(wrapped, None, ("args", "config", [12, 3]), {"rollout_indices": doors.RolloutIds([0, 1, 2],
                                                                                                            TOKENS)})
    assert calls[0][0][2] == [12, 3] and not any(isinstance(n, doors.SampleLength) for n in calls[0][0][2])


def _counted(tokens=TOKENS):
    return [doors.SampleLength(len(t), i, tokens) for i, t in enumerate(tokens)]


def test_the_first_fit_packs_by_the_tokens_computed_by_keyword_and_at_a_budget_of_one_token():
    wrapped, calls = recorder()
    assert doors.first_fit_wrapper(wrapped, None, (), {"total_lengths": _counted(), "max_tokens_per_bin": 16}) == \
        [[0, 1], [2]]  # 10 shared + 2 + 2 = 14 computed (slime's lengths: 24), then 3
    assert doors.first_fit_wrapper(wrapped, None, (_counted(), 1), {}) == [[0], [1], [2]]  # each past 1: alone
    assert calls == []


@pytest.mark.parametrize("args, kwargs", [
    ((), {"total_lengths": [], "max_tokens_per_bin": 8}),  # no lengths
    ((_counted(),), {}),  # no budget given
    ((_counted(), 0), {}),  # a budget under one token
    ((), {"total_lengths": _counted(), "max_tokens_per_bin": 8.0}),  # a budget that is no int
], ids=["empty", "no-budget", "zero-budget", "float-budget"])
def test_the_first_fit_hands_slime_what_it_does_not_pack_as_given(args, kwargs):
    wrapped, calls = recorder()
    assert doors.first_fit_wrapper(wrapped, None, args, kwargs) == "slime's" and calls == [(args, kwargs)]


def test_a_samples_bad_id_is_refused_naming_that_sample():
    tokens = [[1, 2], [3, -4]]
    with pytest.raises(ValueError) as refused:
        doors.first_fit_wrapper(recorder()[0], None, (_counted(tokens), 8), {})
    assert str(refused.value) == "shared_prefix_micro_batches: samples[1][1] is -4, not a token id (0 to 2**63 - 1)"
