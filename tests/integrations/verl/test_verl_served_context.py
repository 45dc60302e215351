"""The privileged context of `verl_topk_kd`'s served teacher (`;context=KEY`), read from the sample
verl's agent-loop worker is scoring (`served.sample_context`, the sample passed as an argument):
ids or text, and each refusal naming the key and the sample, before anything is sent. No verl and
no server needed; the teacher's rows against transformers' float64 run in the verl lane
(lane/test_verl_served.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_rl_patches.integrations.verl.entry import parse_entry
from megatron_rl_patches.integrations.verl.served import sample_context, verl_rows
from megatron_rl_patches.teachers.contract import BatchScores

VARIABLE = "MEGATRON_RL_PATCHES_VERL_TEACHER"
ENTRY = "http://teacher:8000;engine=vllm;context=hint"


@pytest.fixture
def tokenizer_dir(tmp_path):
    pytest.importorskip("tokenizers")
    from megatron_rl_patches.testing.hf_checkpoints import save_word_tokenizer

    save_word_tokenizer(tmp_path, 50)
    return tmp_path


def read(fields, entry=ENTRY, prompt=3):
    return sample_context(parse_entry(entry), list(range(prompt + 4)), (prompt, fields))


def test_ids_as_verls_non_tensor_rows_hold_them_are_the_context():
    for value in (np.array([4, 5, 6]), [4, 5, 6], torch.tensor([4, 5, 6], dtype=torch.int32), np.array(
            [4, 5, 6], dtype=object)):
        context, prompt = read({"hint": value})
        assert torch.equal(context, torch.tensor([4, 5, 6])) and prompt == 3


def test_text_is_tokenized_by_the_named_teacher_tokenizer(tokenizer_dir):
    context, _ = read({"hint": np.array("t7 t8 t9", dtype=object)}, f"{ENTRY};tokenizer={tokenizer_dir}")
    assert context.tolist() == [7, 8, 9]


@pytest.mark.parametrize("fields, entry, error, message", [
    ({"other": [1]}, ENTRY, ValueError, r"prompt of 3 ids.*no non-tensor batch field 'hint'.*\['other'\]"),
    ({"hint": None}, ENTRY, ValueError, r"prompt of 3 ids \(of 7\) has no context under 'hint'"),
    ({"hint": "a hint"}, ENTRY, ValueError, r"context under 'hint' is text and no teacher tokenizer.*;tokenizer=DIR"),
    ({"hint": [1.5, 2.0]}, ENTRY, TypeError, r"context under 'hint' must be text or the teacher's ids"),
    ({"hint": [[1, 2]]}, ENTRY, TypeError, r"context under 'hint' must be text or the teacher's ids"),
])
def test_a_context_verl_cannot_score_is_refused_naming_the_sample_and_key(fields, entry, error, message):
    with pytest.raises(error, match=message) as refused:
        read(fields, entry)
    assert str(refused.value).startswith(VARIABLE)


def test_ids_past_the_teachers_vocabulary_are_refused(tokenizer_dir):
    with pytest.raises(ValueError, match=r"'hint' holds id 50, past the teacher's vocabulary of 50"):
        read({"hint": [3, 50]}, f"{ENTRY};tokenizer={tokenizer_dir}")


def test_outside_verls_agent_loop_a_context_entry_is_refused():
    with pytest.raises(ValueError, match=r"agent-loop worker"):
        sample_context(parse_entry(ENTRY), [1, 2, 3], None)


class Recording:
    """A teacher that answers from a fixed table and keeps the batch it was asked."""

    head = None

    def score(self, batch):
        self.batch = batch
        rows = [batch.response_rows(i) for i in range(len(batch))]
        ids = [torch.arange(2).repeat(r, 1) + 10 for r in rows]
        log_probs = [torch.full((r, 2), -1.0, dtype=torch.float64) for r in rows]
        tokens = [torch.full((r,), -2.0, dtype=torch.float64) for r in rows]
        return BatchScores(tokens, ids, log_probs, [torch.zeros(r, dtype=torch.float64) for r in rows])


def test_the_teacher_scores_the_context_then_the_response_and_verls_prompt_rows_are_zeros():
    teacher = Recording()
    ids, log_probs = verl_rows(teacher, [1, 2, 3, 4, 5, 6], 2, torch.tensor([9, 8]), prompt_length=4)
    assert teacher.batch.sequences[0].tolist() == [9, 8, 5, 6] and teacher.batch.response_starts == [2]
    assert ids.shape == log_probs.shape == (6, 2)
    assert not ids[:3].any() and not log_probs[:3].any() and not ids[-1].any()  # prompt rows, verl's dummy
    assert ids[3:5].tolist() == [[10, 11]] * 2 and log_probs[3:5].eq(-1).all()
    ids, log_probs = verl_rows(teacher, [1, 2, 3, 4, 5, 6], 0, torch.tensor([9, 8]), prompt_length=4)
    assert ids[3:5, 0].tolist() == [5, 6] and log_probs[3:5, 0].eq(-2).all()
