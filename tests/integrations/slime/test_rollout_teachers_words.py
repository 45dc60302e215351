"""`rollout_teachers` in one process: `RolloutTeachers`' student tokenizer (read once from
`--hf-checkpoint`, bounding the contexts' ids), `ask_rows`' response-length refusal said whole and
its bounds, its figures summed over the samples, and a failing teacher's error raised while another
teacher's answer is still out (two stand-in servers in threads). The route against a local server
through slime's hook: `test_slime_rollout_scores.py`."""
from __future__ import annotations

import asyncio
import threading
import types

import pytest

from megatron_rl_patches.integrations.megatron.opd.rollout_teachers import RolloutTeachers, ask_rows
from megatron_rl_patches.teachers import ServedTeacher, ServedTeacherError
from tests.teachers.local_servers import completions, url_of, vllm_like

pytest.importorskip("httpx", reason="the served extra (httpx) is missing")

WHERE = "the hook"


def test_the_students_tokenizer_is_read_once_and_bounds_the_contexts(tmp_path):
    from megatron_rl_patches.testing.hf_checkpoints import save_word_tokenizer

    save_word_tokenizer(tmp_path, 24)
    held = RolloutTeachers(None, types.SimpleNamespace(hf_checkpoint=str(tmp_path)))
    assert held.context_vocab("hint") == 24  # no entry names a vocabulary: the student's tokenizer's
    tokenizer = held.student_tokenizer()
    assert tokenizer.get_vocab_size() == 24 and held.student_tokenizer() is tokenizer
    assert RolloutTeachers(None, types.SimpleNamespace(hf_checkpoint=None)).context_vocab("hint") is None
    with pytest.raises(ValueError) as refused:
        RolloutTeachers(None, types.SimpleNamespace(hf_checkpoint=None)).student_tokenizer()
    assert str(refused.value) == (
        "MEGATRON_RL_PATCHES_OPD_TEACHERS (text contexts are tokenized by the student's tokenizer): a served "
        "teacher's tokenizer is checked against the student's: set slime's --hf-checkpoint to the student's Hugging "
        "Face directory (its tokenizer.json)")


@pytest.mark.parametrize("response", [True, 2.0, 0, 3, 4, -1])
def test_a_response_length_outside_the_tokens_is_refused_whole(response):
    """3 of 3 tokens too: the first token has no log-prob (no prompt before it)."""
    held = RolloutTeachers(None)
    with pytest.raises(ValueError) as refused:
        asyncio.run(ask_rows(held, [5, 6, 7], response, None, sample=9, where=WHERE))
    assert str(refused.value) == (
        f"{WHERE}: sample 9's response_length {response!r} is not within its 3 tokens (the response is their last "
        "response_length, after a prompt of at least one token): hand the hook the sample's whole prompt and "
        "response ids")
    assert (held.samples, held.waited_s) == (0, 0.0)


def test_the_figures_add_up_over_the_samples():
    held = RolloutTeachers(None)
    held.waited_s = 100.0  # an earlier sample's wait: the next one adds to it
    assert asyncio.run(ask_rows(held, [5, 6, 7], 2, None, sample=0)) == {}  # no teachers: nothing to carry
    assert held.samples == 1 and held.waited_s >= 100.0
    asyncio.run(ask_rows(held, [5, 6], 1, None, sample=1))
    assert held.samples == 2 and held.waited_s >= 100.0


@pytest.mark.parametrize("refused_at", ["the server", "its submit"])
def test_a_failing_teacher_is_raised_while_another_teachers_answer_is_still_out(refused_at):
    """The second teacher refuses the sample (a 4xx, or before sending it: longer than its max
    model length); the first's answer, held, is not waited for (neither by the loop nor by its
    `result()`), and nothing is left for the loop to log ("Future exception was never retrieved")."""
    release, failing_now, slow_now, replied = threading.Event(), threading.Event(), threading.Event(), []

    def failing(body):
        return (400, {"detail": "no such prompt"}) if failing_now.is_set() else completions(body)

    def slow(body):  # once slow_now is set: answers when released (or after 30 s: never, unless the test fails)
        if slow_now.is_set():
            release.wait(30.0)
            replied.append(True)
        return completions(body)

    short = {"v1_models": lambda _: (200, {"object": "list", "data": [{"id": "m", "max_model_len": 2}]})} \
        if refused_at == "its submit" else {}
    with vllm_like(v1_completions=failing, **short) as first, vllm_like(v1_completions=slow) as second:
        held = RolloutTeachers(None)
        held.teachers = [ServedTeacher(url_of(second), "vllm", top_k=2), ServedTeacher(url_of(first), "vllm", top_k=2)]
        held.contexts = [None, None]
        try:
            for teacher in held.teachers:
                teacher.check()  # the probes answered before the sample is asked
            failing_now.set()
            slow_now.set()
            with pytest.raises(ServedTeacherError, match=rf"^{WHERE}: .*sample 4\b") as raised:
                asyncio.run(ask_rows(held, [5, 6, 7], 2, None, sample=4, where=WHERE))
            assert raised.value.url == url_of(first) and raised.value.sample == 4
            assert not replied  # raised at the failure, not once every teacher had answered
        finally:
            release.set()
            held.close()
    assert held.samples == 0
