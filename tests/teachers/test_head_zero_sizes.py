"""Zero-size inputs on a served teacher's head path, against the stand-in pooling server: an empty
batch returns 0 samples (as a teacher without a head does), ids of width 0 and samples of no rows
give scores of their shapes in float64, a sample of no rows beside bf16 states keeps bf16, and
NeMo-RL's full-vocabulary route with a `token_mask` marking nothing gives zero states."""
from __future__ import annotations

import dataclasses
import json
import sys
import types

import pytest
import torch

from megatron_rl_patches.teachers import ClientSettings, ServedTeacher, TeacherBatch
from tests.teachers.local_servers import url_of, vllm_like
from tests.teachers.test_teacher_step import H, head, pooled_states

pytest.importorskip("httpx", reason="the served extra (httpx) is missing")

SETTINGS = ClientSettings(retries=0, deadline_s=10)
K = 3


def pooling(body):
    """vLLM's binary pooling reply in the embed dtype asked."""
    states = pooled_states(body["input"])
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[body["embed_dtype"]]
    raw = states.to(dtype).view(torch.uint8).numpy().tobytes()
    item = {"index": 0, "embed_dtype": body["embed_dtype"], "endianness": "little", "start": 0, "end": len(raw),
            "shape": [len(body["input"]), H]}
    return 200, (raw, {"metadata": json.dumps({"data": [item]})})


@pytest.fixture(scope="module")
def server():
    with vllm_like(pooling=pooling) as running:
        yield running


def teacher(server, dtype=None) -> ServedTeacher:
    return ServedTeacher(url_of(server), head=head(), top_k=K, client=SETTINGS, hidden_dtype=dtype)


def test_an_empty_batch_gives_no_sample_as_without_a_head(server):
    with teacher(server) as served, ServedTeacher(url_of(server), top_k=K, client=SETTINGS) as plain:
        for scores in (served.score(TeacherBatch([], [])), plain.score(TeacherBatch([], [])),
                       served.score(TeacherBatch([], []), ids=[])):
            assert scores.token_log_probs == [] and scores.topk_ids == [] and scores.tail_log_probs == []


def test_ids_of_width_zero_give_no_log_prob_and_the_whole_mass_outside(server):
    batch = TeacherBatch([torch.arange(5), torch.arange(4)], [2, 4])  # the second sample has no row
    with teacher(server) as served:
        scores = served.score(batch, ids=[torch.zeros(3, 0, dtype=torch.long), torch.zeros(0, 0, dtype=torch.long)])
    assert [t.shape for t in scores.ids_log_probs] == [(3, 0), (0, 0)]
    assert [t.dtype for t in scores.ids_log_probs + scores.ids_tail_log_probs] == [torch.float64] * 4
    assert torch.equal(scores.ids_tail_log_probs[0], torch.zeros(3, dtype=torch.float64))  # log 1: all outside


def test_samples_of_no_rows_give_float64_scores_of_their_shapes(server):
    batch = TeacherBatch([torch.arange(4), torch.arange(2)], [4, 2])
    with teacher(server) as served:
        scores = served.score(batch, ids=[torch.zeros(0, 2, dtype=torch.long)] * 2)
    for values in (scores.ids_log_probs, scores.ids_tail_log_probs, scores.token_log_probs, scores.topk_log_probs,
                   scores.tail_log_probs):
        assert [t.dtype for t in values] == [torch.float64] * 2
    assert [t.shape for t in scores.ids_log_probs] == [(0, 2)] * 2
    assert [(t.shape, t.dtype) for t in scores.topk_ids] == [((0, K), torch.int64)] * 2
    assert [t.shape for t in scores.hidden_states] == [(0, H)] * 2


def test_a_sample_of_no_rows_beside_bf16_states_keeps_bf16(server):
    batch = TeacherBatch([torch.arange(5), torch.arange(4), torch.arange(3)], [2, 4, 3])
    with teacher(server, torch.bfloat16) as served:
        scores = served.score(batch)
        alone = served.score(TeacherBatch([torch.arange(4)], [4]))
    assert [t.dtype for t in scores.hidden_states + alone.hidden_states] == [torch.bfloat16] * 4
    assert [t.shape for t in scores.hidden_states] == [(3, H), (0, H), (0, H)]
    assert torch.equal(scores.hidden_states[0], pooled_states(list(range(5)))[1:4].bfloat16())


def test_nemo_rls_whole_vocabulary_route_with_a_mask_marking_nothing(server, monkeypatch):
    """NeMo-RL's BatchedDataDict (a dict of tensors) stood in: nemo_rl is in its lane only."""
    from megatron_rl_patches.integrations.nemo_rl import ServedTeacherPolicy

    module = types.ModuleType("nemo_rl.distributed.batched_data_dict")
    module.BatchedDataDict = type("BatchedDataDict", (dict,), {})  # type: ignore[attr-defined]
    for name in ("nemo_rl", "nemo_rl.distributed"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    data = {"input_ids": torch.tensor([[5, 6, 7, 8], [1, 2, 3, 0]]), "input_lengths": torch.tensor([4, 3]),
            "token_mask": torch.zeros(2, 4, dtype=torch.long)}
    # NeMo-RL's workers re-read a whole-vocabulary head from its directory: this one names one (never read here)
    sourced = dataclasses.replace(head(), source="/checkpoints/teacher")
    with ServedTeacher(url_of(server), head=sourced, top_k=K, client=SETTINGS, hidden_dtype=torch.bfloat16) as served:
        out = ServedTeacherPolicy(served, full_vocabulary=True).get_topk_logits(data, K)
    states = out["teacher_hidden_states"]
    assert states.shape == (2, 4, H) and states.dtype == torch.bfloat16 and not states.any()
    assert data["teacher_hidden_states"] is states and out["topk_logits"].shape == (2, 4, K)
    assert torch.equal(out["topk_indices"], torch.arange(K).expand(2, 4, K))  # no row read: ids 0 .. K−1
