"""`teachers.step.share_tensors` in one process: the asking rank's packing and a receiving rank's
unpacking, with the broadcast between them a byte copy of each dtype's buffer as it travels
(`wire`), give back every result bit-identical, of the same types; the asking rank's packing
errors cross as the same kind and words; in a one-rank gloo world `shared_results` hands the
asking rank its own objects. The 2-rank worlds of `test_share_tensors.py` check the same over real
broadcasts; this file reaches the functions in the test process (mutation testing sees it)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megatron_rl_patches.teachers import BatchScores
from megatron_rl_patches.teachers.step.share_tensors import (
    DTYPES,
    ERROR,
    buffers_of,
    described,
    packed,
    raise_error,
    rebuilt,
    shared_results,
    wire,
)
from tests.teachers.test_share_tensors import WRONG, bad_results, every_dtype, exact, served_results


def received(served: object) -> dict:
    """`served` as a receiving rank rebuilds it: the layout as ints, each buffer's wire bytes copied."""
    values, sent, failure = packed(served, torch.device("cpu"))
    assert failure is None, failure
    values = torch.tensor(values, dtype=torch.int64).tolist()  # the layout as the int64 broadcast leaves it
    tensors, skeleton = described(values)
    buffers, offsets = buffers_of(tensors, torch.device("cpu"))
    assert sorted(buffers) == sorted(sent)
    for code, buffer in sent.items():  # each dtype's buffer holds its tensors end to end, nothing more
        assert buffer.numel() == buffers[code].numel() == sum(n for c, _, n, _ in tensors if c == code)
    for code in sorted(sent):
        wire(buffers[code]).copy_(wire(sent[code]))
    return rebuilt(skeleton, tensors, offsets, buffers)


def test_every_field_and_container_is_rebuilt_bit_identical():
    served = served_results()
    assert exact(received(served)) == exact(served)


def test_every_dtype_is_rebuilt_bit_identical():
    served = every_dtype()
    assert exact(received(served)) == exact(served)


def test_the_asking_ranks_packing_errors_cross_as_the_same_kind_and_words():
    for case, (kind, words) in WRONG.items():
        if case == "receiver_gives":
            continue  # the receiving rank's word: the 2-rank world's
        values, buffers, failure = packed(bad_results()[case][0], torch.device("cpu"))
        assert values[0] == ERROR and buffers == {} and type(failure).__name__ == kind, case
        with pytest.raises(Exception) as raised:
            raise_error(torch.tensor(values, dtype=torch.int64).tolist(), failure)
        assert type(raised.value).__name__ == kind and raised.value.__cause__ is failure, case
        assert str(raised.value) == f"TeacherStep: the asking rank could not share its served results: {failure}"
        assert words in str(raised.value), case
    position = " by its teacher's position in the step"
    assert str(packing_error(bad_results()["infinite_index"][0])) == \
        f"shared_results(served=...): teacher index inf is no int: key each result{position}"
    assert str(packing_error(bad_results()["past_int64_index"][0])) == \
        f"shared_results(served=...): teacher index {2 ** 63} is outside 0 .. 2**63 - 1: key each result{position}"


def packing_error(served: object) -> Exception:
    values, _, failure = packed(served, torch.device("cpu"))
    assert values[0] == ERROR and failure is not None
    return failure


TRAVEL = f"only tensors of {[str(d) for d in DTYPES]} travel between ranks"


def test_what_cannot_travel_is_named_whole():
    complex_rows = [torch.zeros(2, dtype=torch.complex64)]
    assert str(packing_error({0: complex_rows})) == f"teacher 0's result[0] is a torch.complex64: {TRAVEL}"
    assert str(packing_error({1: [torch.zeros(2), "rows"]})) == f"teacher 1's result[1] is a str: {TRAVEL}"
    scores = BatchScores([torch.zeros(2)], [torch.zeros(2, 1, dtype=torch.int64)], [torch.zeros(2, 1)],
                         [torch.zeros(2)], hidden_states=complex_rows)
    assert str(packing_error({2: scores})) == f"teacher 2's scores.hidden_states[0] is a torch.complex64: {TRAVEL}"
    scores = dataclasses.replace(scores, hidden_states=None,
                                 ids_log_probs=torch.zeros(2))  # a tensor where per-sample tensors are due
    assert str(packing_error({2: scores})) == \
        "teacher 2's scores.ids_log_probs must be a list of per-sample tensors, got Tensor"
    assert str(packing_error({3: 7})) == \
        "teacher 3's result is a int: only BatchScores or a list of per-sample tensors travel between ranks"


class Unindexable:
    """A key whose `__index__` fails with an error of no kind the layout names."""

    def __index__(self) -> int:
        raise ZeroDivisionError("no index")


def test_an_error_of_another_kind_crosses_as_a_runtime_error():
    values, _, failure = packed({Unindexable(): [torch.zeros(2)]}, torch.device("cpu"))
    assert isinstance(failure, ZeroDivisionError)
    with pytest.raises(RuntimeError, match=r"^TeacherStep: the asking rank could not share its served results: "
                                           r"no index$"):
        raise_error(values, failure)


@pytest.fixture
def one_rank_world():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_the_asking_rank_of_a_one_rank_group_gets_its_own_objects_back(one_rank_world):
    served = served_results()
    assert shared_results(served, one_rank_world) is served
    with pytest.raises(TypeError, match=r"^TeacherStep: the asking rank could not share its served results: "
                                        r"shared_results\(served=...\) on the asking rank must be a dict") as raised:
        shared_results([torch.zeros(2)], one_rank_world)
    assert isinstance(raised.value.__cause__, TypeError)  # the asking rank's own error, chained
