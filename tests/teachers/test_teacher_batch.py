"""TeacherBatch: whole sequences and where each response starts; bad input refused by name."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.teachers import TeacherBatch


def test_rows_per_sample():
    batch = TeacherBatch([torch.arange(5), torch.tensor([3, 1, 2], dtype=torch.int32)], [2, 3])
    assert len(batch) == 2 and [batch.response_rows(i) for i in range(2)] == [3, 0]


@pytest.mark.parametrize(("sequences", "starts", "error", "words"), [
    ([torch.arange(4)], [0], ValueError, r"response_starts\[0\] = 0 is outside \[1, 4\]"),
    ([torch.arange(4)], [5], ValueError, r"response_starts\[0\] = 5 is outside \[1, 4\]"),
    ([torch.arange(4), torch.arange(3)], [1], ValueError, "2 sequences but 1 response_starts"),
    ([torch.arange(4).float()], [1], TypeError, r"sequences\[0\] must be a 1-D integer id tensor"),
    ([torch.zeros(2, 3, dtype=torch.long)], [1], TypeError, r"sequences\[0\] must be a 1-D integer id tensor"),
    ([[1, 2, 3]], [1], TypeError, r"sequences\[0\] must be a 1-D integer id tensor, got list \(torch.tensor\(ids\) "
                                  r"makes one\)"),
    ([torch.arange(4).to("meta")], [1], ValueError, r"sequences\[0\] is on the meta device \(a shape without data\)"),
    ([torch.tensor([1, -2, 3])], [1], ValueError, r"sequences\[0\] holds a negative id"),
    ([torch.arange(4)], [1.5], TypeError, r"response_starts\[0\] must be an int"),
    ([torch.arange(4)], [True], TypeError, r"response_starts\[0\] must be an int"),
    (torch.arange(4), [1], TypeError, "must be a list of 1-D id tensors"),
])
def test_bad_input_is_refused_by_name(sequences, starts, error, words):
    with pytest.raises(error, match=words):
        TeacherBatch(sequences, starts)
