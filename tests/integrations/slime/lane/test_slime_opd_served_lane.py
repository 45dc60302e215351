"""slime_opd with a teacher served by a real vLLM server (its CPU build, MRP_VLLM_PYTHON, as the
served lane starts it) through slime 624b824a's real `MegatronTrainRayActor.train_actor`: the
served teacher first (its own top-k are the buckets, MEGATRON_RL_PATCHES_OPD_IDS_FROM=teacher), a
snapshot teacher beside it, at one rank and TP=2; the first step's OPD loss and every gradient
against dense float64 (the served checkpoint built alone in float64: the lane's transformers has no
Qwen3, so the kit writes it and its converter builds the reference). Without
MRP_VLLM_PYTHON the test skips naming it (the slime lane is outside `make test`)."""
from __future__ import annotations

import pytest
import torch

from tests.integrations.slime.lane.served_qwen3_kit import VLLM_PYTHON, VOCAB, served_checkpoint

pytestmark = pytest.mark.slime

WEIGHTS = (0.3, 0.7)  # slime_ranks.OPD_ENV's: the served teacher, the snapshot


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from megatron_rl_patches.testing.vllm_server import vllm_server

    root = tmp_path_factory.mktemp("served")
    directory = served_checkpoint(root)
    with vllm_server(VLLM_PYTHON, directory, root / "vllm.log", max_model_len=256, max_logprobs=20) as server:
        yield server.url, str(directory)


@pytest.mark.parametrize("tensor", [1, 2])
def test_train_actor_with_a_served_teacher_first_equals_dense_float64(slime_cpu, served, tensor):
    import slime_kit as kit
    import slime_ranks

    from megatron_rl_patches.integrations.slime import opd as slime_opd
    from megatron_rl_patches.testing.multirank import run_multirank

    url, directory = served
    entries = {"entries": f"{url};engine=vllm,teacher-a", "student": directory}
    ranks = run_multirank(slime_ranks.opd_train_actor, tensor, 1, 1, tensor, None, None, (), 1, None, 1, None, None,
                          entries, timeout=400)
    for rank in ranks:
        assert rank["keys"] == sorted([slime_opd.IDS, slime_opd.TEACHER_LOGPROBS, slime_opd.TEACHER_TAILS])
        assert rank["teacher_figures"]["samples"] > 0 and rank["teacher_figures"]["taken_out"] == 0  # the dashboard's

    def whole(field, tag=None):
        return kit.unsplit([r[field] if tag is None else r[field][tag] for r in ranks], ranks[0]["split"])

    states, grads = {tag: whole("states", tag) for tag in ranks[0]["states"]}, whole("grads")
    with kit.slime_session("--loss-type", "custom_loss", "--custom-loss-function-path", slime_ranks.OPD_LOSS) as args:
        full = kit.provider_func(args)()
        names = [name for name, _ in full.named_parameters()]
        with torch.no_grad():
            for name, p in full.named_parameters():
                p.copy_(states["actor"][name])
        data = kit.rollout(0)
        ids = kit.whole_ids(ranks, 1, tensor)
        teacher = kit.hf_teacher_logps(directory, data, 1.0, VOCAB)
        for sample_ids, logp in zip(ids, teacher):  # the served teacher's own top-k, ties aside
            assert (sample_ids.sort(-1).values == logp.topk(sample_ids.shape[-1]).indices.sort(-1).values).float() \
                .mean() > 0.9
        snapshot = [states["opd_teacher_1"][name] for name in names]
        expected, student = dense_with(kit, args, full, teacher, snapshot, data, ids)
    (losses,) = ranks[-1]["losses"]
    loss_error = abs(float(losses["opd_topk_loss"]) - float(expected))
    grad_error = max((grads[name].double() - p.grad).abs().max().item() for name, p in student.named_parameters())
    print(f"slime_opd train_actor TP={tensor} with a served teacher vs dense float64: loss {float(expected):.6f}, "
          f"|Δloss| {loss_error:.2e}, max |Δgrad| {grad_error:.2e}")
    assert loss_error <= 1e-5 * max(1.0, abs(float(expected)))
    for name, p in student.named_parameters():
        torch.testing.assert_close(grads[name].double(), p.grad, rtol=1e-4, atol=1e-6, msg=name)


def dense_with(kit, args, full, served_logps, snapshot, data, ids):
    """kit.dense_topk_opd with the served teacher's dense float64 log-softmaxes given."""
    student = kit.float64_copy(args, [p.detach() for p in full.parameters()])
    with torch.no_grad():
        other = kit.response_logps(kit.float64_copy(args, snapshot), data, 1.0)
    total = kit.dense_opd_loss(kit.response_logps(student, data, 1.0), [served_logps, other], data, ids, WEIGHTS)
    total.backward()
    return total, student
