"""verl's live self-teacher pass (`integrations.verl.self_teacher.student_pass`) runs the student's
model chunk in eval mode (no dropout in a teacher's scores, even where the update configures it) and
hands the chunk back in the mode it was in; its rows are the response's final hidden states (the
output layer's input, through megatron-core's `output_processor=` hook)."""
from __future__ import annotations

import torch

from megatron_rl_patches.integrations.verl.self_teacher import student_pass
from megatron_rl_patches.teachers.batch import TeacherBatch


class Chunk(torch.nn.Module):
    """A model chunk with dropout on its hidden states (p = 0.5): rows differ between calls in train mode."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 11)
        self.dropout = torch.nn.Dropout(0.5)
        self.output_layer = torch.nn.Linear(11, 11, bias=False)
        self.modes: list[bool] = []

    def forward(self, ids, positions, mask, output_processor):
        self.modes.append(self.training)
        hidden = self.dropout(self.embed(ids)).transpose(0, 1)  # [s, b, H], as megatron-core hands it over
        return output_processor(hidden_states=hidden, output_layer=self.output_layer)


def test_the_pass_runs_in_eval_mode_and_restores_the_chunks_mode():
    chunk = Chunk().train()
    batch = TeacherBatch([torch.tensor([1, 2, 3, 4, 5]), torch.tensor([6, 7, 8])], [2, 1])
    run = student_pass(chunk, 2)
    first, second = run(batch), run(batch)
    assert chunk.modes == [False] * 4 and chunk.training  # eval inside, train again after
    for one, again, sequence, start in zip(first.hidden, second.hidden, batch.sequences, batch.response_starts):
        assert torch.equal(one, again)  # no dropout mask: the same rows every call
        assert torch.equal(one, chunk.embed.weight[sequence[start - 1:-1]].detach())  # row r predicts token start + r
    chunk.eval()
    run(batch)
    assert not chunk.training  # an eval chunk stays eval
