"""The invariant mode's fixed-point sums at the vocabulary limit (issue 63 item 2): with 2^-44 units, a
row whose sum covers every column of a uniform row reaches V·2^44, which is 2^63 — past int64 — at
V = 2^19 (log_probs_and_entropy; the top-k ops with `ids_mask` all False; at TP = 2 the integer
all-reduce of two 2^18 shards): NaN. 2^19 ids are refused by name; 2^19 − 1 is the largest vocabulary
served, and its uniform row gives log p = −log V exactly as the default mode does, on one rank and
at TP = 2 (in the TP = 2 invariance world, invariance_worlds.py)."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_rl_patches import ops

LIMIT = 1 << 19  # refused: V·2^44 = 2^63
LARGEST = LIMIT - 1
H = 4


def _calls(vocab: int, group=None, world: int = 1):
    """Each op over one uniform row (two rows: a uniform one and a peaked one) of `vocab` ids, as
    `(name, call(invariant)) -> tensors`; at TP = world each rank holds its shard of the columns."""
    import torch.distributed as dist

    rank = dist.get_rank() if group is not None else 0
    local = -(-vocab // world)  # the padded shard: the last rank's padded columns excluded by vocab_size
    x = torch.zeros(2, local)
    x[1, 0] = 5.0 if rank == 0 else 0.0
    w = torch.zeros(local, H)
    h = torch.zeros(2, H)
    tokens = torch.tensor([0, 1])
    ids = torch.tensor([[0, 1], [2, 3]])
    none = torch.zeros(2, 2, dtype=torch.bool)  # the tail covers every column
    common = dict(tp_group=group, vocab_size=vocab)
    return {
        "log_probs_and_entropy": lambda inv: ops.log_probs_and_entropy(
            x, tokens, with_entropy=True, invariant=inv, **common),
        "topk_logprobs": lambda inv: ops.topk_logprobs(x, ids, ids_mask=none, invariant=inv, **common),
        "topk_opd_loss": lambda inv: (ops.topk_opd_loss(
            x, ids, torch.full((2, 2), -1.0), torch.full((2,), -1.0), ids_mask=none, invariant=inv, **common),),
        "lm_head_log_probs_and_entropy": lambda inv: ops.lm_head_log_probs_and_entropy(
            h, w, tokens, with_entropy=True, invariant=inv, **common),
        "lm_head_topk_logprobs": lambda inv: ops.lm_head_topk_logprobs(
            h, w, ids, ids_mask=none, invariant=inv, **common),
    }


def _outcome(call, invariant):
    try:
        return [t.detach().clone() for t in call(invariant) if t is not None]
    except ValueError as exc:
        return str(exc)


def limit_checks(rank: int, world: int) -> dict:
    """At TP = world: each op's outcome at 2^19 ids (a refusal's text) and at 2^19 − 1 (both modes)."""
    import torch.distributed as dist

    group = dist.group.WORLD
    out = {}
    for name, call in _calls(LIMIT, group, world).items():
        out[name, "limit"] = _outcome(call, True)
    for name, call in _calls(LARGEST, group, world).items():
        out[name, "largest"] = (_outcome(call, True), _outcome(call, False))
    return out


def _check_refused(name: str, outcome) -> None:
    assert isinstance(outcome, str), f"{name} at {LIMIT} ids ran: {outcome}"
    assert f"{name}(invariant=True)" in outcome and str(LARGEST) in outcome and "invariant=False" in outcome, outcome


def _check_served(name: str, invariant, default) -> None:
    assert not isinstance(invariant, str), invariant
    for a, b in zip(invariant, default, strict=True):
        assert not torch.isnan(a).any(), (name, a)  # masked slots are -inf
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    if name.endswith("log_probs_and_entropy"):
        assert float(invariant[0][0]) == pytest.approx(-math.log(LARGEST), rel=1e-6)  # the uniform row
    if name.endswith("topk_logprobs"):
        assert float(invariant[1][0]) == pytest.approx(0.0, abs=1e-6)  # the whole mass in the tail
        assert torch.isneginf(invariant[0]).all()


@pytest.mark.parametrize("name", list(_calls(8)))
def test_the_limit_is_refused_by_name_and_the_largest_vocabulary_is_served(name):
    _check_refused(name, _outcome(_calls(LIMIT)[name], True))
    call = _calls(LARGEST)[name]
    _check_served(name, _outcome(call, True), _outcome(call, False))


def test_the_fixed_point_check_refuses_from_the_limit_on():
    from megatron_rl_patches.ops.invariance import MAX_VOCAB, check_vocab

    assert MAX_VOCAB == LARGEST
    check_vocab(LARGEST, "log_probs_and_entropy")
    with pytest.raises(ValueError, match=rf"up to {LARGEST} ids"):
        check_vocab(LIMIT, "log_probs_and_entropy")


@pytest.mark.multirank
def test_at_tp2_the_limit_is_refused_on_every_rank_and_the_largest_is_served(invariance_world):
    ranks = invariance_world.results(2, "vocab_limit")
    for results in ranks:
        for (name, where), outcome in results.items():
            if where == "limit":
                _check_refused(name, outcome)
            else:
                _check_served(name, *outcome)
    assert len(ranks[0]) == 2 * len(_calls(8))
