"""`slime_opd.score_teachers` at pipeline parallelism 2 (issue 40): 2 gloo ranks with Megatron's
parallel state, two snapshot teachers. Each top-k pass stands for a pipelined `forward_only`: stage
0 sends its activations to stage 1 and gets no buckets, stage 1 receives them and returns buckets.
Before the fix, stage 0 returned after the actor's pass (no ids there) while stage 1 ran a teacher
pass alone and waited to receive (a hang, or a closed connection once stage 0 exited); now both
stages switch to every teacher and run its pass in the same order, and only stage 1's rollout
data receives the fields. The slime lane runs the same through slime's real `train_actor`."""
from __future__ import annotations

import pytest

pytestmark = [pytest.mark.megatron, pytest.mark.multirank]

RESPONSES = (3, 2)
K = 2


class _Actor:
    """What score_teachers reads of slime's actor: args, model, the snapshot switch and its teachers."""

    def __init__(self, log: list):
        from megatron_rl_patches.integrations.slime import opd

        self.args, self.model, self._active_model_tag, self.log = None, ["chunk"], "actor", log
        setattr(self, opd.ATTRIBUTE, ["opd_teacher_0", "opd_teacher_1"])

    def _switch_model(self, tag: str) -> None:
        self._active_model_tag = tag
        self.log.append(("switch", tag))


def _scored_on_two_stages(rank: int, world_size: int) -> dict:
    """Both cases in one world: the last stage's actor pass with ids, then without."""
    from megatron_rl_patches.testing.megatron_cpu import megatron_world

    with megatron_world("cpu", pipeline_parallel=2):
        return {**{with_work: _scored(with_work) for with_work in (True, False)}, "fallback": _fell_back()}


def _fell_back() -> dict:
    """The real `topk_pass` over a pipelined pass whose last stage got logits (a slime_fused
    fallback, e.g. a separate teacher without GPTModel's output_processor keyword): every stage
    must raise, agreed, before any enters the next pass (before the fix: stage 1 raised alone and
    stage 0 went on to send in the next teacher pass)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_rl_patches.integrations.megatron.opd.opd_settings import opd_settings
    from megatron_rl_patches.integrations.slime import opd

    def logits_on_the_last_stage(args, model, rollout_data, request, fell_back, invariant=None):
        activations = torch.zeros(4)
        if parallel_state.is_pipeline_first_stage():
            dist.send(activations, dst=1)
            return {}
        dist.recv(activations, src=0)
        return opd.collect_topk(torch.zeros(1, 5, 8), total_lengths=[5], response_lengths=[2],
                                fell_back=fell_back)[1]

    real, opd.pipelined_topk = opd.pipelined_topk, logits_on_the_last_stage
    settings = opd_settings({"MEGATRON_RL_PATCHES_OPD_TEACHERS": "/a,/b", "MEGATRON_RL_PATCHES_OPD_K": str(K)})
    try:
        opd.score_teachers(_Actor([]), {"tokens": []}, settings)
    except RuntimeError as exc:
        return {"error": str(exc)}
    finally:
        opd.pipelined_topk = real
    return {"error": None}


def _scored(with_work: bool) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_rl_patches.integrations.megatron.opd.opd_settings import opd_settings
    from megatron_rl_patches.integrations.slime import opd
    log: list = []
    actor = _Actor(log)

    def pipelined_pass(args, model, rollout_data, request, invariant=None):
        """One forward_only over the pipeline: stage 0 sends, stage 1 receives and scores."""
        activations = torch.zeros(4)
        if parallel_state.is_pipeline_first_stage():
            dist.send(activations + len(log), dst=1)
            log.append(("pass", actor._active_model_tag))
            return {}
        dist.recv(activations, src=0)
        log.append(("pass", actor._active_model_tag, int(activations[0])))
        if not with_work:  # a last stage whose actor pass has no ids: nobody runs teacher passes
            return {}
        tag = actor._active_model_tag
        out = {"topk_log_probs": [torch.full((r, K), float(len(tag))) for r in RESPONSES],
               "tail": [torch.zeros(r) for r in RESPONSES]}
        if request.k is not None:
            out["topk_ids"] = [torch.arange(r * K).reshape(r, K) for r in RESPONSES]
        return out

    real, opd.topk_pass = opd.topk_pass, pipelined_pass
    settings = opd_settings({"MEGATRON_RL_PATCHES_OPD_TEACHERS": "/a,/b", "MEGATRON_RL_PATCHES_OPD_K": str(K)})
    data: dict = {"tokens": []}
    try:
        opd.score_teachers(actor, data, settings)
    finally:
        opd.topk_pass = real
    return {"log": log, "keys": sorted(data), "active": actor._active_model_tag,
            "scores": [tuple(t.shape) for t in data.get(opd.TEACHER_LOGPROBS, [])]}


@pytest.fixture(scope="module")
def stages() -> list:
    from megatron_rl_patches.testing.multirank import run_multirank

    return run_multirank(_scored_on_two_stages, 2, timeout=60)


def test_both_stages_enter_every_teacher_pass_in_the_same_order(stages):
    from megatron_rl_patches.integrations.slime import opd

    first, last = (stage[True] for stage in stages)
    tags = ["actor", "opd_teacher_0", "opd_teacher_1"]
    for stage in (first, last):
        passes = [entry[1] for entry in stage["log"] if entry[0] == "pass"]
        switches = [entry[1] for entry in stage["log"] if entry[0] == "switch"]
        assert passes == tags and switches == ["opd_teacher_0", "opd_teacher_1", "actor"]
        assert stage["active"] == "actor"
    assert first["keys"] == ["tokens"]  # the ids and buckets live on the last stage only
    assert set(last["keys"]) == {"tokens", opd.IDS, opd.TEACHER_LOGPROBS, opd.TEACHER_TAILS}
    assert last["scores"] == [(2, r, K) for r in RESPONSES]


def test_no_ids_on_the_last_stage_skips_the_teacher_passes_on_every_stage(stages):
    for stage in (stage[False] for stage in stages):
        assert [entry[1] for entry in stage["log"]] == ["actor"] and stage["keys"] == ["tokens"]


def test_a_fallback_on_the_last_stage_is_agreed_and_raised_on_every_stage(stages):
    from megatron_rl_patches.integrations.slime import opd

    for stage in stages:
        assert stage["fallback"]["error"] == opd.FELL_BACK
