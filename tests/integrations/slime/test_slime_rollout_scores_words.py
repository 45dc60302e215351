"""slime's rollout hook (`integrations.slime.rollout_scores`) in the cases its route tests pass by:
a sample's text context tokenized by the student's tokenizer and id 0 taken, the no-ids and
negative-id refusals said whole (`sample_contexts` in memory); a sample without a status, or a
status without a name, scored (only ABORTED is left alone); slime's `log_rollout_data` handed its
own arguments untouched where the rollout asked no teacher. The route against a local server:
`test_slime_rollout_scores.py`."""
from __future__ import annotations

import asyncio
import types

import pytest

from megatron_rl_patches.integrations.megatron.opd.carried_rows import ROWS
from megatron_rl_patches.integrations.megatron.opd.rollout_teachers import RolloutTeachers
from megatron_rl_patches.integrations.slime import rollout_scores
from tests.teachers.local_servers import url_of, vllm_like

pytest.importorskip("httpx", reason="the served extra (httpx) is missing")


def with_context(tmp_path) -> RolloutTeachers:
    """The rollout's teachers as `sample_contexts` reads them: one with `;context=ctx` (no server
    asked), the student's tokenizer a word-level one of 16 words."""
    from megatron_rl_patches.testing.hf_checkpoints import save_word_tokenizer

    save_word_tokenizer(tmp_path, 16)
    held = RolloutTeachers(None, types.SimpleNamespace(hf_checkpoint=str(tmp_path)))
    held.contexts = ["ctx", None]
    return held


def contexts_of(held: RolloutTeachers, context: object) -> list[int]:
    (got,) = rollout_scores.sample_contexts(held, types.SimpleNamespace(index=7, train_metadata={"ctx": context}))
    return got["ctx"].tolist()


def test_a_text_context_is_tokenized_by_the_students_tokenizer_and_id_0_is_taken(tmp_path):
    held = with_context(tmp_path)
    assert contexts_of(held, "t3 t5") == [3, 5]
    assert contexts_of(held, [0, 3]) == [0, 3]


@pytest.mark.parametrize(("context", "what"), [([], "holds no ids"), ([-2, 3], "holds a negative id (-2)")])
def test_a_context_without_ids_or_with_a_negative_id_is_refused_whole(tmp_path, context, what):
    with pytest.raises(ValueError) as refused:
        contexts_of(with_context(tmp_path), context)
    assert str(refused.value) == (
        f"slime_opd (the rollout's sample hook, score_sample): sample 7's train_metadata['ctx'] {what}: the teacher "
        "reads the context's ids (its vocabulary indices) before the response; fill it in the rollout's generate "
        "function")


@pytest.mark.parametrize("status", ["missing", None], ids=["no-status", "status-without-a-name"])
def test_a_sample_without_a_status_or_its_name_is_scored(monkeypatch, status):
    with vllm_like() as server:
        monkeypatch.setenv("MEGATRON_RL_PATCHES_OPD_TEACHERS", f"{url_of(server)};engine=vllm")
        monkeypatch.setenv("MEGATRON_RL_PATCHES_OPD_K", "2")
        monkeypatch.setenv("MEGATRON_RL_PATCHES_OPD_IDS_FROM", "teacher")
        monkeypatch.setenv("MEGATRON_RL_PATCHES_OPD_SCORE_AT", "rollout")
        args = types.SimpleNamespace(rollout_sample_hook_path=None, hf_checkpoint=None)
        sample = types.SimpleNamespace(index=0, tokens=[5, 9, 2, 7], response_length=2, train_metadata=None)
        if status is None:
            sample.status = None
        try:
            asyncio.run(rollout_scores.score_sample(args, sample))
        finally:
            rollout_scores.rollout_teachers(args).close()
    assert ROWS in sample.train_metadata


def test_slimes_log_rollout_data_gets_its_own_arguments_where_no_teacher_was_asked():
    def log_rollout_data(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
        return rollout_id, args, samples, rollout_extra_metrics, rollout_time

    for args in (types.SimpleNamespace(), types.SimpleNamespace(**{rollout_scores.ATTRIBUTE: RolloutTeachers(None)})):
        given = (3, args, ["s"], {"x": 1.0}, 2.5)
        assert rollout_scores.log_rollout_data_wrapper(log_rollout_data, None, given, {}) == given
