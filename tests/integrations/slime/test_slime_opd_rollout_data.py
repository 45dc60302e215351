"""What `slime_opd` adds to slime's rollout data survives slime's own paths (issue 40): slime's
`log_rollout_data` averages every tensor list outside its ignore sets, which failed on the int64
`opd_topk_ids` ("mean(): could not infer output dtype ... Long") on TP rank 0 of the last stage;
the debug dumps pickle the rollout data; `get_batch` hands each micro-batch its samples' entries.
On the stand-in slime (tests/standins/slime, the same control flow; the slime lane runs slime's)."""
from __future__ import annotations

import io
import pickle

import pytest
import torch

from megatron_rl_patches.integrations.megatron.opd import opd_teachers
from megatron_rl_patches.integrations.megatron.opd import topk_request as keys

RESPONSES, K, TEACHERS = (3, 5), 4, 2


def rollout_data(union: bool) -> dict:
    """slime's fields for two samples, then what score_teachers adds (as it adds them)."""
    g = torch.Generator().manual_seed(0)
    data = {
        "tokens": [torch.arange(7 + r) for r in RESPONSES],
        "response_lengths": list(RESPONSES),
        "total_lengths": [7 + r for r in RESPONSES],
        "loss_masks": [torch.ones(r, dtype=torch.int) for r in RESPONSES],
        "rewards": [0.5, -1.0],
        "log_probs": [-torch.rand(r, generator=g) for r in RESPONSES],
    }
    width = 2 * K if union else K
    data[keys.IDS] = [torch.randint(0, 64, (r, width), generator=g) for r in RESPONSES]
    if union:
        data[keys.IDS_MASK] = [torch.rand(r, width, generator=g) > 0.3 for r in RESPONSES]
    data[keys.TEACHER_LOGPROBS] = [-torch.rand(TEACHERS, r, width, generator=g) for r in RESPONSES]
    data[keys.TEACHER_TAILS] = [-torch.rand(TEACHERS, r, generator=g) for r in RESPONSES]
    return data


@pytest.fixture
def metrics(slime_standin, clean_patch_state):
    import slime.observability.train_metric_utils as metrics

    return metrics


@pytest.mark.parametrize("union", [False, True], ids=["student ids", "union ids with mask"])
def test_slimes_rollout_metrics_run_and_leave_the_opd_fields_to_the_steps(metrics, union):
    import megatron_rl_patches

    data = rollout_data(union)
    with pytest.raises(RuntimeError, match="could not infer output dtype"):
        metrics.log_rollout_data(0, None, data)  # unpatched: slime's own failure
    slimes_own = {key: value for key, value in data.items() if key not in keys.OPD_KEYS}
    expected = metrics.log_rollout_data(0, None, slimes_own)

    statuses = megatron_rl_patches.apply(only="slime_opd")
    assert {s.status for s in statuses if s.target == f"{metrics.__name__}:log_rollout_data"} == {"applied"}
    entries = {key: list(value) if isinstance(value, list) else value for key, value in data.items()}
    assert metrics.log_rollout_data(0, None, data) == expected  # positional, as slime's actor calls it
    assert metrics.log_rollout_data(rollout_id=0, args=None, rollout_data=data) == expected
    assert set(expected) == {"response_lengths", "total_lengths", "rewards", "log_probs"}
    # the rollout data itself is untouched: the training steps read the same entries
    assert data.keys() == entries.keys()
    assert all(a is b for key in data if isinstance(data[key], list) for a, b in zip(data[key], entries[key]))


def test_the_opd_fields_survive_the_debug_dump_and_the_micro_batches(metrics):
    """The debug dump pickles every per-sample field (gather_object, torch.save); get_batch's
    iterator picks each micro-batch's samples from every key it is asked for."""
    data = rollout_data(union=True)
    buffer = io.BytesIO()
    torch.save(pickle.loads(pickle.dumps(data)), buffer)
    restored = torch.load(io.BytesIO(buffer.getvalue()))
    for key in (key for key in keys.OPD_KEYS if key not in keys.CROSS_KEYS):  # no teacher of another tokenizer
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(restored[key], data[key]))
    micro_batch = [1]
    fetched = {key: [data[key][i] for i in micro_batch] for key in opd_teachers.UNION_STEP_REQUEST.keys}
    assert [tuple(t.shape) for t in fetched[keys.TEACHER_LOGPROBS]] == [(TEACHERS, RESPONSES[1], 2 * K)]
    assert fetched[keys.IDS][0].dtype == torch.int64 and fetched[keys.IDS_MASK][0].dtype == torch.bool
