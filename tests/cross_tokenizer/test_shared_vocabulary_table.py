"""`SharedVocabulary.string_of` on a hand-built table (no tokenizer): each side reads its own table,
an id outside it (negative, or a padded output row past the vocabulary) is -1, and the table
follows the ids' device. Mutation testing found the side swapped or one table read for both (the
tests built from one tokenizer on both sides cannot tell), id 0 or the last id dropped, an outside id looked up at 1."""
from __future__ import annotations

import torch

from megatron_rl_patches.cross_tokenizer.vocabulary import SharedVocabulary


def _vocabulary() -> SharedVocabulary:
    """Strings a, b, c; student ids 0..3 spell a, (none), c, b; teacher ids 0..2 spell b, a, c."""
    return SharedVocabulary(strings=[b"a", b"b", b"c"], student_string=torch.tensor([0, -1, 2, 1]),
                            teacher_string=torch.tensor([1, 0, 2]), student_ids=torch.tensor([0, 3, 2]),
                            student_offsets=torch.tensor([0, 1, 2, 3]), teacher_ids=torch.tensor([1, 0, 2]),
                            teacher_offsets=torch.tensor([0, 1, 2, 3]))


def test_string_of_reads_each_sides_table_and_gives_minus_one_outside_it():
    vocabulary = _vocabulary()
    ids = torch.tensor([[0, 1, 2, 3], [-1, 4, 3, 0]])
    assert vocabulary.string_of(ids, "student").tolist() == [[0, -1, 2, 1], [-1, -1, 1, 0]]
    assert vocabulary.string_of(ids, "teacher").tolist() == [[1, 0, 2, -1], [-1, -1, -1, 1]]
    assert vocabulary.string_of(ids.to("meta"), "teacher").device.type == "meta"  # the table follows the ids
    one = SharedVocabulary(strings=[b"a"], student_string=torch.tensor([0]), teacher_string=torch.tensor([0]),
                           student_ids=torch.tensor([0]), student_offsets=torch.tensor([0, 1]),
                           teacher_ids=torch.tensor([0]), teacher_offsets=torch.tensor([0, 1]))
    assert one.string_of(torch.tensor([-1, 0, 5]), "student").tolist() == [-1, 0, -1]  # a one-id table
