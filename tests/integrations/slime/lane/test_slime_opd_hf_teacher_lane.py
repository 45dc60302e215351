"""slime_opd through slime 624b824a's real `MegatronTrainRayActor.train_actor` (issue 41) with one
same-architecture teacher (slime's snapshot route) and one Hugging Face teacher of another size
(hidden 48 and 4 layers against the actor's 32 and 2; vocab 64, padded to 128 by Megatron), named
by its directory in MEGATRON_RL_PATCHES_OPD_TEACHERS: at one rank, PP=2 (the teacher's 4 layers
split 2 + 2 over the actor's stages) and PP=2xVPP=2 (one teacher layer per virtual chunk), each
world spawned once. The first step's OPD loss
and every gradient against dense float64, the Hugging Face teacher's log-softmax over its real
64 ids (its padding rows get no mass: the negative control scores them and misses)."""
from __future__ import annotations

import sys

import pytest
import torch

from megatron_rl_patches.testing import layouts

pytestmark = pytest.mark.slime

WEIGHTS = (0.3, 0.7)
OTHER = dict(hidden_size=48, num_hidden_layers=4, intermediate_size=64, vocab_size=64, max_position_embeddings=64)
# (pipeline, virtual chunks) -> layout marks
LAYOUTS = {"pp1": ((1, None), ("thd",)), "pp2": ((2, None), ("pp2", "thd")),
           "pp2vpp2": ((2, 2), ("pp2", "vpp2", "thd"))}
HF_LAYERS = {"pp1": [[[1, 2, 3, 4]]], "pp2": [[[1, 2]], [[3, 4]]], "pp2vpp2": [[[1], [3]], [[2], [4]]]}


@pytest.fixture(scope="module", params=[pytest.param(name, marks=layouts.mark(*LAYOUTS[name][1]))
                                        for name in LAYOUTS])
def world(request, tmp_path_factory):
    if "slime_standins" not in sys.modules:  # the lane's conftest installs them where slime's source is found
        pytest.skip("slime is not importable; run `make test-slime SLIME=... MEGATRON_LM=...`")
    import slime_ranks  # the lane folder is on sys.path (conftest)

    from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, write_tiny_checkpoint
    from megatron_rl_patches.testing.multirank import run_multirank

    hf = tmp_path_factory.mktemp("hf") / "teacher"
    write_tiny_checkpoint(hf, tiny_hf_config("qwen3", **OTHER), seed=12)
    (pipeline, virtual), _ = LAYOUTS[request.param]
    return request.param, virtual, str(hf), run_multirank(slime_ranks.opd_train_actor, pipeline, pipeline, 1, 1,
                                                          virtual, str(hf), timeout=300)


def test_train_actor_with_a_snapshot_and_a_hugging_face_teacher_equals_dense_float64(slime_cpu, world):
    import slime_kit as kit
    import slime_ranks

    from megatron_rl_patches.integrations.slime import opd as slime_opd

    layout, virtual, hf, ranks = world
    assert [r["hf_layers"] for r in ranks] == HF_LAYERS[layout]
    assert all(r["active"] == "actor" for r in ranks) and ranks[0]["split"]
    last = ranks[-1]
    assert last["keys"] == sorted([slime_opd.IDS, slime_opd.TEACHER_LOGPROBS, slime_opd.TEACHER_TAILS])
    states = {tag: {k: v for r in ranks for k, v in r["states"][tag].items()} for tag in ("actor", "opd_teacher_0")}
    grads = {k: v for r in ranks for k, v in r["grads"].items()}
    data = kit.rollout(0)
    with kit.slime_session("--loss-type", "custom_loss", "--custom-loss-function-path", slime_ranks.OPD_LOSS,
                           *slime_ranks.virtual_args(virtual)[:2]) as args:  # the whole actor: its layers
        student, snapshot = kit.student_and_snapshot(args, states, data, slime_ranks.TEMPERATURE)
        assert sorted(grads) == sorted(name for name, _ in student.named_parameters())
        hf_logps = kit.hf_teacher_logps(hf, data, slime_ranks.TEMPERATURE, kit.VOCAB)
        padded = kit.hf_teacher_logps(hf, data, slime_ranks.TEMPERATURE, None)  # the negative control
        students = kit.response_logps(student, data, slime_ranks.TEMPERATURE)
        expected = kit.dense_opd_loss(students, [snapshot, hf_logps], data, last["ids"], WEIGHTS)
        with torch.no_grad():
            unmasked = kit.dense_opd_loss(students, [snapshot, padded], data, last["ids"], WEIGHTS)
        expected.backward()
    (losses,) = last["losses"]
    loss_error = abs(float(losses["opd_topk_loss"]) - float(expected))
    grad_error = max((grads[name].double() - p.grad).abs().max().item() for name, p in student.named_parameters())
    print(f"slime_opd train_actor {layout}, a snapshot and a Hugging Face teacher of another size vs dense "
          f"float64: loss {float(expected):.6f}, |Δloss| {loss_error:.2e}, max |Δgrad| {grad_error:.2e}; padding "
          f"rows scored: |Δloss| {abs(float(unmasked) - float(expected)):.2e}")
    assert loss_error <= 1e-5 * max(1.0, abs(float(expected)))
    assert abs(float(losses["opd_topk_loss"]) - float(unmasked)) > 100 * max(loss_error, 1e-7)
    for name, p in student.named_parameters():
        torch.testing.assert_close(grads[name].double(), p.grad, rtol=1e-4, atol=1e-6, msg=name)
