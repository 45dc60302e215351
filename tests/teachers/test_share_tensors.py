"""A step's served results cross the sharing group as tensors (`teachers.step.share_tensors`), in a real
2-rank gloo world with pickled broadcasts forbidden: every field of `BatchScores` (float64 / float32
log-probs, int64 top-k ids, bf16 hidden states) and a head's per-sample states (bf16, fp8, empty and
zero-row samples, a tuple) arrive bit-identical, of the same dtypes, shapes and containers, in two
layout broadcasts and one broadcast per dtype; through `TeacherStep` a bf16 pooling stand-in's
states arrive bit-identical on both ranks; a result that cannot travel and a failed ask are the
same error on both ranks. Every dtype of `DTYPES` travels over gloo bit-identical (int16, which
gloo and NCCL refuse, as its bytes); the asking rank's bad results (a list where a dict is due,
None, an infinite or past-int64 teacher index) and a receiving rank's stray results are the same
error on both ranks at once, never a rank left waiting in the layout's broadcast."""
from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
import torch

from megatron_rl_patches.teachers import (
    BatchScores,
    LoopHost,
    ServedTeacher,
    ServedTeacherError,
    ServedTeacherRefusal,
    TeacherBatch,
    TeacherHead,
    TeacherStep,
)
from megatron_rl_patches.testing.multirank import run_multirank
from tests.teachers.local_servers import url_of, vllm_like

H, K = 8, 3
ROWS = (4, 0, 2)  # a zero-row sample in the middle


def scores_with_every_field() -> BatchScores:
    gen = torch.Generator().manual_seed(7)
    return BatchScores([torch.randn(r, dtype=torch.float64, generator=gen) for r in ROWS],
                       [torch.randint(0, 2 ** 40, (r, K), generator=gen) for r in ROWS],
                       [torch.randn(r, K, dtype=torch.float64, generator=gen) for r in ROWS],
                       [torch.randn(r, dtype=torch.float64, generator=gen) for r in ROWS],
                       hidden_states=[torch.randn(r, H, generator=gen).bfloat16() for r in ROWS],
                       ids_log_probs=[torch.randn(r, 2, generator=gen) for r in ROWS],  # float32
                       ids_tail_log_probs=None)


def head_states() -> list[torch.Tensor]:
    """A head teacher's unprojected result: states per sample, a no-response sample's (0, 0) float32."""
    gen = torch.Generator().manual_seed(8)
    return [torch.randn(3, H, generator=gen).bfloat16(), torch.zeros(0, 0), torch.zeros(0, H, dtype=torch.bfloat16),
            torch.randn(2, H, generator=gen).to(torch.float8_e4m3fn), torch.randn(2, H, generator=gen)[:, ::2]]


def served_results() -> dict:
    return {0: scores_with_every_field(), 2: head_states(), 3: tuple(torch.arange(r, dtype=torch.int32) for r in ROWS)}


def exact(value) -> object:
    """A result as comparable values: containers, dtypes, shapes and the tensors' bytes."""
    if isinstance(value, dict):
        return {key: exact(part) for key, part in value.items()}
    if isinstance(value, BatchScores):
        return ("BatchScores", {name: exact(getattr(value, name)) for name in value.__dataclass_fields__})
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [exact(part) for part in value])
    if isinstance(value, torch.Tensor):
        return (str(value.dtype), tuple(value.shape), value.contiguous().view(torch.uint8).tolist())
    return value


def pooled(ids: list[int]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(len(ids))
    return (torch.tensor(ids, dtype=torch.float32)[:, None] + torch.randn(len(ids), H, generator=gen)).bfloat16()


def pooling(body):
    raw = pooled(body["input"]).view(torch.int16).numpy().tobytes()
    item = {"index": 0, "embed_dtype": "bfloat16", "endianness": "little", "start": 0, "end": len(raw),
            "shape": [len(body["input"]), H]}
    return 200, (raw, {"metadata": json.dumps({"data": [item]})})


def step_batch() -> TeacherBatch:
    return TeacherBatch([torch.tensor([5, 9, 2, 7, 11]), torch.tensor([3, 8]), torch.tensor([6, 4, 10, 2])], [2, 2, 3])


def every_dtype() -> dict:
    """One tensor of each dtype that travels, every byte random (all of a dtype's bit patterns: NaN
    payloads, negative zeros, int16's extremes)."""
    from megatron_rl_patches.teachers.step.share_tensors import DTYPES

    gen = torch.Generator().manual_seed(11)
    tensors = []
    for dtype in DTYPES:
        size = torch.empty(0, dtype=dtype).element_size()
        raw = torch.randint(0, 256, (6 * size,), dtype=torch.uint8, generator=gen)
        raw = (raw % 2) if dtype == torch.bool else raw  # a bool's byte is 0 or 1
        tensors.append(raw.view(dtype).reshape(2, 3))
    return {0: tensors}


def bad_results() -> dict:
    """Each case: what rank 0 (the asking rank) and rank 1 pass; one of them wrong."""
    good = {0: [torch.zeros(2)]}
    return {
        "list_for_dict": ([torch.zeros(2)], None),
        "none_on_asker": (None, None),
        "infinite_index": ({float("inf"): [torch.zeros(2)]}, None),
        "past_int64_index": ({2 ** 63: [torch.zeros(2)]}, None),
        "receiver_gives": (good, good),
    }


def rank_bad_sharing(rank: int) -> dict:
    """Every case on a fresh group of a 5 s timeout: a rank left waiting fails the case in 5 s, not
    the world."""
    import torch.distributed as dist

    from megatron_rl_patches.teachers.step.share_tensors import shared_results

    out = {}
    for name, passed in bad_results().items():
        group = dist.new_group([0, 1], timeout=timedelta(seconds=5))
        start = time.monotonic()
        try:
            shared_results(passed[rank], group)
            said = ("", "no error")
        except Exception as error:  # noqa: BLE001 - compared between the ranks
            said = (type(error).__name__, str(error))
        out[name] = (said, time.monotonic() - start)
    return out


def rank_sharing(rank: int, world_size: int, url: str) -> dict:
    import torch.distributed as dist

    from megatron_rl_patches.teachers.step.share_tensors import shared_results

    out: dict = {"bad": rank_bad_sharing(rank)}
    first_only = dist.new_group([0])  # rank 1 is no member: refused before any collective
    try:
        out["not_a_member"] = "no error" if rank == 0 else shared_results(None, first_only)
    except ValueError as error:
        out["not_a_member"] = str(error)
    dtypes_group = dist.new_group([0, 1], timeout=timedelta(seconds=5))
    try:
        out["dtypes"] = exact(shared_results(every_dtype() if rank == 0 else None, dtypes_group))
    except Exception as error:  # noqa: BLE001 - compared with the expected values below
        out["dtypes"] = f"{type(error).__name__}: {error}"

    def pickled(*args, **kwargs):
        raise AssertionError("a step's results were pickled across ranks (broadcast_object_list)")

    dist.broadcast_object_list = pickled
    broadcasts = []
    plain = dist.broadcast

    def counted(tensor, *args, **kwargs):
        broadcasts.append(str(tensor.dtype))
        return plain(tensor, *args, **kwargs)

    dist.broadcast = counted
    gather = dist.all_gather

    def gathered(tensors, tensor, *args, **kwargs):
        broadcasts.append(f"all_gather {tensor.dtype}")
        return gather(tensors, tensor, *args, **kwargs)

    dist.all_gather = gathered
    got = shared_results(served_results() if rank == 0 else None, dist.group.WORLD)
    out["direct"] = exact(got)
    out["broadcasts"] = list(broadcasts)
    try:
        shared_results({0: [torch.zeros(2, dtype=torch.complex64)]} if rank == 0 else None, dist.group.WORLD)
        out["cannot_travel"] = "no error"
    except TypeError as error:
        out["cannot_travel"] = str(error)
    host = LoopHost(vocab_size=12, share_group=dist.group.WORLD, job_group=dist.group.WORLD)
    weight = torch.randn(12, H, generator=torch.Generator().manual_seed(5))
    head = TeacherHead(weight=weight, vocab_size=12, padded_vocab_size=12, first_id=0)
    with ServedTeacher(url, "vllm", top_k=K, head=head, hidden_dtype=torch.bfloat16) as served:
        step = TeacherStep([served], host)
        step.send(step_batch())
        (states,) = step.collect(projected=False)
        out["step_states"] = exact(states)
        step.send(TeacherBatch([torch.arange(70) % 12], [1]))  # over the stand-in's max model length of 64
        try:
            step.collect()
            out["failed_ask"] = "no error"
        except (ServedTeacherError, ServedTeacherRefusal) as error:
            out["failed_ask"] = f"{type(error).__name__}: {error}"
    return out


@pytest.fixture(scope="module")
def sharing_world() -> list[dict]:
    """The module's one 2-rank world: every check below runs in it."""
    with vllm_like(pooling=pooling) as server:
        return run_multirank(rank_sharing, 2, url_of(server), timeout=120)


@pytest.mark.multirank
def test_served_results_cross_ranks_as_tensors_bit_identical_and_failures_alike(sharing_world):
    ranks = sharing_world
    assert ranks[0]["direct"] == ranks[1]["direct"] == exact(served_results())
    # each rank's word and the layout's length (one int64 all-gather), the layout (int64), then one per dtype:
    # float64, float32, bfloat16, int64, int32, fp8
    assert ranks[1]["broadcasts"] == ["all_gather torch.int64", "torch.int64", "torch.float64", "torch.float32",
                                      "torch.bfloat16", "torch.int64", "torch.int32", "torch.uint8"]
    assert ranks[0]["cannot_travel"] == ranks[1]["cannot_travel"]
    assert "teacher 0's result[0] is a torch.complex64" in ranks[0]["cannot_travel"]
    samples = step_batch()
    expected = [pooled(ids.tolist())[start - 1: -1] if start < len(ids)
                else torch.zeros(0, H, dtype=torch.bfloat16)  # nothing asked: [0, H] in the states' dtype
                for ids, start in zip(samples.sequences, samples.response_starts)]
    assert ranks[0]["step_states"] == ranks[1]["step_states"] == exact(expected)
    assert ranks[0]["failed_ask"] == ranks[1]["failed_ask"] and "max model length" in ranks[0]["failed_ask"]
    assert ranks[1]["not_a_member"] == ("shared_results: this rank (1) is not in the group passed: pass its sharing "
                                        "group")


WRONG = {  # what every rank raises, at once
    "list_for_dict": ("TypeError", "shared_results(served=...) on the asking rank must be a dict {teacher index: "
                                   "result}, got list"),
    "none_on_asker": ("TypeError", "shared_results(served=...) on the asking rank must be a dict {teacher index: "
                                   "result}, got NoneType"),
    "infinite_index": ("TypeError", "teacher index inf is no int"),
    "past_int64_index": ("ValueError", f"teacher index {2 ** 63} is outside 0 .. 2**63 - 1"),
    "receiver_gives": ("ValueError", "rank 1 of the group passed results (served=...) but only the group's first "
                                     "rank (rank 0) shares: pass None on the others"),
}


@pytest.mark.multirank
def test_every_dtype_travels_and_one_ranks_bad_results_are_the_same_error_on_every_rank(sharing_world):
    ranks = sharing_world
    expected = exact(every_dtype())
    assert ranks[0]["dtypes"] == ranks[1]["dtypes"] == expected, ranks[1]["dtypes"] if isinstance(
        ranks[1]["dtypes"], str) else "bits differ"
    for case, (kind, words) in WRONG.items():
        (said0, seconds0), (said1, seconds1) = ranks[0]["bad"][case], ranks[1]["bad"][case]
        assert said0 == said1, (case, said0, said1)
        assert said0[0] == kind and words in said0[1], (case, said0)
        assert max(seconds0, seconds1) < 4, (case, seconds0, seconds1)  # at once: the group's timeout is 5 s
