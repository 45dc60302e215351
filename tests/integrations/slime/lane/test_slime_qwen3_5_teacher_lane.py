"""A Qwen3.5 checkpoint directory inside slime (issue 46): the PRM-teacher role (`inference_roles`,
`prm_teacher` with a Hugging Face load path) built inference-only by slime's real
`initialize_model_and_optimizer` from a tiny Qwen3.5 directory (the vision-language wrapper's
layout as transformers and the model cards write it, the text model under `text_config`; three
gated-delta-net layers and one gated full-attention layer), with the actor on the test kit's packed
CPU attention (`--spec`): the full-attention layer runs the actor's core, the
linear-attention layers keep their own module. slime's real `forward_only` over packed batches gives
the teacher's log-probs, equal to the build's float64 unpacked forward (which the main lane holds to
transformers') and bit for bit across `role`, `role:stream` and `role:swap`. And slime_opd through
slime's real `MegatronTrainRayActor.train_actor` with that Qwen3.5 directory as a teacher beside the
snapshot teacher (same 64-id tokenizer as the student), at one rank and TP=2 (the gated delta nets'
heads split over tensor ranks): the teacher's log-probs, the first step's OPD loss and every
gradient against dense float64; the negative control scores the teacher's padding rows and misses.
A Qwen3.5 teacher with the student at PP=2 and PP=2 x VPP=2: test_slime_opd_hf_teacher_lane.py;
Qwen3.5-MoE and Qwen3-Next teachers at one rank, TP=2 and EP=2: test_slime_opd_hf_moe_teachers_lane.py."""
from __future__ import annotations

import sys

import pytest
import torch

import megatron_rl_patches
from megatron_rl_patches.testing import layouts

pytestmark = pytest.mark.slime

OTHER = dict(hidden_size=48, num_hidden_layers=4, intermediate_size=64, vocab_size=64, max_position_embeddings=64)
TEMPERATURE = 0.8
WEIGHTS = (0.3, 0.7)  # the snapshot teacher, the Qwen3.5 teacher
LAYOUTS = {"pp1": (1, ("thd",)), "tp2": (2, ("tp2", "thd"))}  # layout -> (tensor ranks, layout marks)
TOL = 3e-4  # the float32 build alone (unpacked) is 1.5e-4 from float64 here: log-probs reach -21


@layouts.mark("thd")
def test_qwen3_5_prm_teacher_role_equals_float64_on_every_residency(slime_cpu, tmp_path, monkeypatch):
    import slime_kit as kit  # the lane folder is on sys.path (conftest)
    from slime_ranks import ACTOR_SPEC

    from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, transformers_layout, write_tiny_checkpoint

    hf = str(tmp_path / "prm")
    write_tiny_checkpoint(hf, transformers_layout(tiny_hf_config("qwen3_5", **OTHER)), seed=5)
    reference = kit.hf_teacher_token_logps(hf, kit.rollout(0), TEMPERATURE)
    megatron_rl_patches.apply(only=["inference_roles"])
    try:
        resident, role = kit.prm_role_log_probs(hf, "prm_teacher", monkeypatch, TEMPERATURE, *ACTOR_SPEC)
        names = [type(getattr(layer.self_attention, "core_attention", layer.self_attention)).__name__
                 for layer in role.decoder.layers]
        streamed, _ = kit.prm_role_log_probs(hf, "prm_teacher:stream", monkeypatch, TEMPERATURE, *ACTOR_SPEC)
        swapped, _ = kit.prm_role_log_probs(hf, "prm_teacher:swap", monkeypatch, TEMPERATURE, *ACTOR_SPEC)
    finally:
        megatron_rl_patches.revert()
    assert names[3] == "PackedDotProductAttention"  # the full-attention layer: the actor's core
    assert len(set(names[:3])) == 1 and "DotProductAttention" not in names[0]  # the gated delta nets kept
    error = max((a.double() - r.double()).abs().max().item() for a, r in zip(resident, reference))
    print(f"prm_teacher (qwen3_5 wrapper, hidden 48, 3 linear + 1 full attention) through slime forward_only, "
          f"packed, vs float64 unpacked: max |Δlogp| {error:.2e}; layers {names}")
    assert [a.shape for a in resident] == [r.shape for r in reference]
    assert error <= TOL
    shifted = max((a.double() - r.double().roll(1)).abs().max().item() for a, r in zip(resident, reference))
    assert shifted > 100 * max(error, 1e-7)  # the comparison sees a one-token misalignment
    for a, b, c in zip(resident, streamed, swapped):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.fixture(scope="module", params=[pytest.param(name, marks=layouts.mark(*LAYOUTS[name][1]))
                                        for name in LAYOUTS])
def world(request, tmp_path_factory):
    if "slime_standins" not in sys.modules:  # the lane's conftest installs them where slime's source is found
        pytest.skip("slime is not importable; run `make test-slime SLIME=... MEGATRON_LM=...`")
    import slime_ranks  # the lane folder is on sys.path (conftest)

    from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, transformers_layout, write_tiny_checkpoint
    from megatron_rl_patches.testing.multirank import run_multirank

    hf = tmp_path_factory.mktemp("hf") / "qwen3_5"
    write_tiny_checkpoint(hf, transformers_layout(tiny_hf_config("qwen3_5", **OTHER)), seed=12)
    tensor, _ = LAYOUTS[request.param]
    ranks = run_multirank(slime_ranks.opd_train_actor, tensor, 1, 1, tensor, None, str(hf), (), 1, None, 1,
                          ",".join(map(str, WEIGHTS)), timeout=600)
    return request.param, str(hf), ranks


def test_train_actor_with_a_qwen3_5_teacher_equals_dense_float64(slime_cpu, world):
    import slime_kit as kit
    import slime_ranks

    from megatron_rl_patches.integrations.slime import opd as slime_opd

    layout, hf, ranks = world
    tensor, _ = LAYOUTS[layout]
    last = ranks[-1]
    assert all(r["active"] == "actor" for r in ranks)
    assert last["keys"] == sorted([slime_opd.IDS, slime_opd.TEACHER_LOGPROBS, slime_opd.TEACHER_TAILS])
    assert [r["hf_layers"] for r in ranks] == [[[1, 2, 3, 4]]] * tensor  # the teacher whole on each rank
    split = ranks[0]["split"]
    states = {tag: {name: value if tensor == 1 or split[name] is None
                    else torch.cat([r["states"][tag][name] for r in ranks], split[name])
                    for name, value in ranks[0]["states"][tag].items()} for tag in ("actor", "opd_teacher_0")}
    grads = {name: value if tensor == 1 or split[name] is None
             else torch.cat([r["grads"][name] for r in ranks], split[name])
             for name, value in ranks[0]["grads"].items()}
    data, ids = kit.rollout(0), last["ids"]
    with kit.slime_session("--loss-type", "custom_loss", "--custom-loss-function-path", slime_ranks.OPD_LOSS) as args:
        student, snapshot = kit.student_and_snapshot(args, states, data, slime_ranks.TEMPERATURE)
        assert sorted(grads) == sorted(name for name, _ in student.named_parameters())
        real = kit.hf_teacher_logps(hf, data, slime_ranks.TEMPERATURE, kit.VOCAB)
        padded = kit.hf_teacher_logps(hf, data, slime_ranks.TEMPERATURE, None)  # the negative control
        students = kit.response_logps(student, data, slime_ranks.TEMPERATURE)
        expected = kit.dense_opd_loss(students, [snapshot, real], data, ids, WEIGHTS)
        with torch.no_grad():
            unmasked = kit.dense_opd_loss(students, [snapshot, padded], data, ids, WEIGHTS)
        expected.backward()
    teacher_error = max((scored[1].double() - logp.gather(-1, sample_ids)).abs().max().item()
                        for scored, logp, sample_ids in zip(last["teacher_logprobs"], real, ids))
    (losses,) = last["losses"]
    loss_error = abs(float(losses["opd_topk_loss"]) - float(expected))
    grad_error = max((grads[name].double() - p.grad).abs().max().item() for name, p in student.named_parameters())
    print(f"slime_opd train_actor {layout}, a snapshot and a Qwen3.5 teacher (hidden 48, 3 linear + 1 full "
          f"attention) vs dense float64: teacher log-probs max |Δ| {teacher_error:.1e}; loss {float(expected):.6f}, "
          f"|Δloss| {loss_error:.2e}, max |Δgrad| {grad_error:.2e}; padding rows scored: |Δloss| "
          f"{abs(float(unmasked) - float(expected)):.2e}")
    assert teacher_error <= TOL
    assert loss_error <= 1e-5 * max(1.0, abs(float(expected)))
    assert abs(float(losses["opd_topk_loss"]) - float(unmasked)) > 100 * max(loss_error, 1e-7)
    for name, p in student.named_parameters():
        torch.testing.assert_close(grads[name].double(), p.grad, rtol=1e-4, atol=1e-6, msg=name)
