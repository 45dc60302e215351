"""The live self-teacher's rows kept from verl's old-log-prob pass (`integrations.verl.old_rows`):
one pass's rows at a time, read back by content, forgotten when a new pass starts."""
from __future__ import annotations

import torch

from megatron_rl_patches.integrations.verl.old_rows import OldRows, sample_key


def rows(value: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(3, 2, dtype=torch.int32), torch.full((3, 2), value)


def test_keys_name_the_sequence_its_start_and_k():
    sequence = torch.tensor([7, 8, 21, 22, 23])
    key = sample_key(sequence, 2, 4)
    assert key == sample_key(sequence.clone().int(), 2, 4)
    assert len({key, sample_key(sequence, 3, 4), sample_key(sequence, 2, 5),
                sample_key(torch.tensor([8, 7, 21, 22, 23]), 2, 4)}) == 4


def test_a_pass_keeps_its_rows_until_the_next_pass_starts():
    kept = OldRows()
    first, second = sample_key(torch.tensor([1, 2, 3]), 1, 2), sample_key(torch.tensor([4, 5, 6]), 1, 2)
    kept.note_step(10)
    kept.put(first, *rows(-1.0))
    kept.note_step(10)  # the same pass's next micro-batch
    kept.put(second, *rows(-2.0))
    kept.note_step(None)  # the update
    found = kept.get([second, first])
    assert found is not None and [float(lp[0, 0]) for _, lp in found] == [-2.0, -1.0]
    assert kept.get([first, sample_key(torch.tensor([9]), 1, 2)]) is None  # one missing: none
    kept.note_step(10)  # a new pass (even with the last one's iterator id, after another step)
    assert kept.get([first]) is None and kept.get([second]) is None
    kept.put(first, *rows(-3.0))
    kept.note_step(11)  # another pass straight after
    assert kept.get([first]) is None


def test_each_engine_holds_its_own_rows():
    """Held by verl's engine (the actor's passes run on one), not by the module (issue 87 item 5):
    another engine (a reference policy's) neither sees nor forgets them."""
    from types import SimpleNamespace

    from megatron_rl_patches.integrations.verl.old_rows import old_rows_of

    actor, reference = SimpleNamespace(), SimpleNamespace()
    key = sample_key(torch.tensor([1, 2, 3]), 1, 2)
    old_rows_of(actor).note_step(7)
    old_rows_of(actor).put(key, *rows(-1.0))
    old_rows_of(reference).note_step(None)  # the reference policy's step between the actor's
    old_rows_of(actor).note_step(7)  # the same pass's next micro-batch: nothing forgotten
    assert old_rows_of(actor) is old_rows_of(actor) and old_rows_of(reference).get([key]) is None
    assert old_rows_of(actor).get([key]) is not None


def test_forget_drops_the_rows_and_the_pass_so_the_same_pass_id_starts_afresh():
    kept = OldRows()
    key = sample_key(torch.tensor([1, 2, 3]), 1, 2)
    kept.note_step(10)
    kept.put(key, *rows(-1.0))
    kept.forget()
    assert kept.get([key]) is None and kept.pass_id is None
    kept.put(key, *rows(-2.0))
    kept.note_step(10)  # the first micro-batch of a pass after the forgetting, even with the last one's id
    assert kept.get([key]) is None
