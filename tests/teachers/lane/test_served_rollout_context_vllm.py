"""slime's rollout-time scoring (`rollout_scores.score_sample`, MEGATRON_RL_PATCHES_OPD_SCORE_AT=rollout)
against the lane's real vLLM server (issue 96 item 5): a privileged context id past the teacher's
named vocabulary (`;same_tokenizer;vocab=N;context=ctx`) is refused before the rollout sends it,
naming the rollout's sample and the key, the server never asked (vLLM itself answered such a
prompt with "HTTP 400: Token id ... is out of vocabulary", reported as "sample 0"); a context
inside the vocabulary is scored by the server as the rollout's rows. No server of its own: the
lane's shared one (conftest.py)."""
from __future__ import annotations

import asyncio
import re
import types

import pytest

from megatron_rl_patches.integrations.megatron.opd.carried_rows import ROWS
from megatron_rl_patches.integrations.slime import rollout_scores
from tests.teachers.lane.served_kit import VOCAB


def rollout_sample(index: int, context: list[int]) -> types.SimpleNamespace:
    """A sample as slime's rollout hands it to its hooks (the fields the hook reads)."""
    return types.SimpleNamespace(index=index, tokens=[5, 9, 2, 7, 11], response_length=3,
                                 train_metadata={"ctx": context}, status=types.SimpleNamespace(name="COMPLETED"))


def requests_of(held: rollout_scores.RolloutTeachers) -> int:
    """The requests the rollout's teachers sent since the last read."""
    return sum(replica["requests"] for replica in held.metrics()["replicas"].values())


def test_a_context_id_past_the_vocabulary_is_refused_before_the_rollout_sends_it(served, monkeypatch):
    monkeypatch.setenv("MEGATRON_RL_PATCHES_OPD_TEACHERS", f"{served.url};engine=vllm;same_tokenizer;vocab={VOCAB};"
                                                           "context=ctx")
    monkeypatch.setenv("MEGATRON_RL_PATCHES_OPD_K", "4")
    monkeypatch.setenv("MEGATRON_RL_PATCHES_OPD_IDS_FROM", "teacher")
    monkeypatch.setenv("MEGATRON_RL_PATCHES_OPD_SCORE_AT", "rollout")
    args = types.SimpleNamespace(rollout_sample_hook_path=None, hf_checkpoint=None)
    past, inside = rollout_sample(37, [3, VOCAB + 11]), rollout_sample(38, [3, VOCAB - 1])
    try:
        with pytest.raises(ValueError, match=re.escape(
                f"{rollout_scores.WHERE}: sample 37's train_metadata['ctx'] holds id {VOCAB + 11}, past the teacher's "
                f"vocabulary of {VOCAB}")):
            asyncio.run(rollout_scores.score_sample(args, past))
        held = rollout_scores.rollout_teachers(args)
        assert held is not None
        sent_before = requests_of(held)
        asyncio.run(rollout_scores.score_sample(args, inside))
        sent_after = requests_of(held)
    finally:
        if isinstance(getattr(args, rollout_scores.ATTRIBUTE, None), rollout_scores.RolloutTeachers):
            getattr(args, rollout_scores.ATTRIBUTE).close()
    assert sent_before == 0 and ROWS not in past.train_metadata  # the server never asked for sample 37
    assert sent_after >= 1 and ROWS in inside.train_metadata  # the same teacher scores a context inside
