"""slime_opd through slime 624b824a's real `MegatronTrainRayActor.train_actor` (issue 40) at one
rank, TP=2, PP=2, PP=2×VPP=2, CP=2 zigzag, PP=2×CP=2 and TP=2×PP=2×CP=2 (up to 8 gloo ranks, each
a fresh interpreter): slime's own log-prob pass, advantages, `log_rollout_data` (which must not see the
int64 ids) and `train()`, with two snapshot teachers. The first step's OPD loss and every gradient
against dense float64 over the ranks' weights put back together (stages joined, tensor-parallel
shards concatenated; the ids from each context-parallel rank's zigzag rows). With pipeline
parallelism the stages agree to run every teacher's pipelined pass (before the fix the last stage
ran them alone and waited: no result within 300 s)."""
from __future__ import annotations

import sys

import pytest
import torch

from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.layouts import BY_MARKER

EP2 = BY_MARKER["ep2"].megatron_lm_args
ALLGATHER_CP = BY_MARKER["cp2-allgather"].megatron_lm_args
NOPE = layouts.NOPE_ARGS
pytestmark = pytest.mark.slime

WEIGHTS = (0.3, 0.7)


# (pipeline, context, tensor, virtual chunks, slime's extra flags): ranks = pipeline · context ·
# tensor in Megatron's order (tp fastest, then cp; pp slowest). "cp2ag": slime's --allgather-cp
# (the lane declares a DSA architecture to slime's own check, slime_ranks.DSA_CONFIG).
LAYOUTS = {"pp1": (1, 1, 1, None, ()), "pp2": (2, 1, 1, None, ()), "cp2": (1, 2, 1, None, ()),
           "tp2": (1, 1, 2, None, ()), "tp2sp": (1, 1, 2, None, BY_MARKER["sp"].megatron_lm_args),
           "cp2ag": (1, 2, 1, None, ALLGATHER_CP), "ep2": (1, 1, 1, None, EP2), "pp2vpp2": (2, 1, 1, 2, ()),
           "pp2cp2": (2, 2, 1, None, ()),
           "tp2pp2cp2": (2, 2, 2, None, ())}
ROLLOUTS = 3  # train_actor re-entered: the teacher passes and slime's train() of rollouts 0, 1, 2


# docs/layouts.md: slime packs thd; its context parallelism is megatron-core's zigzag or (--allgather-cp) contiguous
MARKS = {"pp1": ("thd",), "pp2": ("pp2", "thd"), "cp2": ("cp2-zigzag", "thd"), "tp2": ("tp2", "thd"),
         "tp2sp": ("tp2", "sp", "thd"), "cp2ag": ("cp2-allgather", "thd"), "ep2": ("ep2", "thd"),
         "pp2vpp2": ("pp2", "vpp2", "thd"), "pp2cp2": ("pp2", "cp2-zigzag", "thd"),
         "tp2pp2cp2": ("tp2", "pp2", "cp2-zigzag", "thd")}


@pytest.fixture(scope="module", params=[pytest.param(name, marks=layouts.mark(*MARKS[name])) for name in LAYOUTS])
def world(request):
    if "slime_standins" not in sys.modules:  # the lane's conftest installs them where slime's source is found
        pytest.skip("slime is not importable; run `make test-slime SLIME=... MEGATRON_LM=...`")
    import slime_ranks  # the lane folder is on sys.path (conftest)

    from megatron_rl_patches.testing.multirank import run_multirank

    pipeline, context, tensor, virtual, flags = LAYOUTS[request.param]
    expert = _experts(flags)
    return pipeline, context, tensor, virtual, flags, run_multirank(
        slime_ranks.opd_train_actor, pipeline * context * tensor * expert, pipeline, context, tensor, virtual, None,
        flags, ROLLOUTS, None, expert, timeout=300)


def _experts(flags: tuple[str, ...]) -> int:
    """The expert-parallel size (the EP=2 world is DP=2: each rank holds the whole rollout)."""
    return 2 if flags == EP2 else 1


def test_train_actor_with_two_teachers_equals_dense_float64(slime_cpu, world):
    import slime_kit as kit
    import slime_ranks

    from megatron_rl_patches.integrations.slime import opd as slime_opd

    pipeline, context, tensor, virtual, flags, ranks = world
    expert = _experts(flags)
    last, per_stage = ranks[-1], context * tensor * expert
    for stage in ranks:
        assert stage["active"] == "actor"
    for stage in ranks[:-per_stage]:  # the ids and teacher buckets live on the last stage only
        assert stage["keys"] == [] and stage["losses"] is None
    for rank in ranks[-per_stage:]:
        assert rank["keys"] == sorted([slime_opd.IDS, slime_opd.TEACHER_LOGPROBS, slime_opd.TEACHER_TAILS])
    # per stage, its first context-parallel rank's tensor-parallel shards (CP ranks replicate the weights)
    stages = [ranks[first:first + tensor] for first in range(0, len(ranks), per_stage)]

    def whole(field, tag=None):
        def of(rank):
            return rank[field] if tag is None else rank[field][tag]

        if expert > 1:  # one stage, its experts split over the EP ranks, the rest replicated (rank 0's kept)
            return {name: value for rank in reversed(ranks) for name, value in of(rank).items()}
        return kit.whole_stages([kit.unsplit([of(r) for r in shards], shards[0]["split"]) for shards in stages])

    states = {tag: whole("states", tag) for tag in ranks[0]["states"]}
    grads = whole("grads")
    with kit.slime_session("--loss-type", "custom_loss", "--custom-loss-function-path", slime_ranks.OPD_LOSS,
                           *slime_ranks.virtual_args(virtual)[:2],  # the whole model: its layers
                           *(NOPE if NOPE[0] in flags else ()),  # and its positions
                           *(EP2[:4] + EP2[6:] if expert > 1 else ()),  # and all experts on one rank
                           **(slime_ranks.MOE_VALUES if expert > 1 else {})) as args:
        full = kit.provider_func(args)()
        names = [name for name, _ in full.named_parameters()]
        assert sorted(names) == sorted(states["actor"]) == sorted(grads)
        with torch.no_grad():
            for name, p in full.named_parameters():
                p.copy_(states["actor"][name])
        snapshots = [[states[tag][name] for name in names] for tag in ("opd_teacher_0", "opd_teacher_1")]
        data = kit.rollout(0)
        ids = kit.whole_ids(ranks, context, tensor)
        expected, student = kit.dense_topk_opd(args, [full], snapshots, data, ids, WEIGHTS, slime_ranks.TEMPERATURE)
    losses, *later = last["losses"]
    assert len(later) == ROLLOUTS - 1  # re-entry: every rollout's step ran its teacher passes and OPD loss
    assert all(torch.isfinite(torch.as_tensor(step["opd_topk_loss"])) for step in later)
    assert not all(torch.equal(a, b) for a, b in zip(last["ids"], last["last_ids"]))
    loss_error = abs(float(losses["opd_topk_loss"]) - float(expected))
    grad_error = max((grads[name].double() - p.grad).abs().max().item() for name, p in student.named_parameters())
    print(f"slime_opd train_actor PP={pipeline} VPP={virtual} CP={context} TP={tensor} {' '.join(flags)} "
          "vs dense float64: "
          f"loss {float(expected):.6f}, "
          f"|Δloss| {loss_error:.2e}, max |Δgrad| {grad_error:.2e}")
    assert loss_error <= 1e-5 * max(1.0, abs(float(expected)))
    for name, p in student.named_parameters():
        torch.testing.assert_close(grads[name].double(), p.grad, rtol=1e-4, atol=1e-6, msg=name)
