"""slime_opd through slime 624b824a's real `MegatronTrainRayActor.train_actor` (issue 41) with one
same-architecture teacher (slime's snapshot route) and two Hugging Face teachers of another size
(hidden 48 and 4 layers against the actor's 32 and 2; vocab 64, padded to 128 by Megatron), named
by their directories in MEGATRON_RL_PATCHES_OPD_TEACHERS: a Qwen3 and a Qwen3.5 (issue 58: the
vision-language wrapper's layout as transformers writes it, three gated-delta-net layers and one
gated full-attention layer, on the actor's `--spec` packed attention core), at one rank, CP=2 (each
rank its zigzag rows; the Qwen3.5's gated delta nets exchange rows over the context-parallel group,
its full-attention layer on the actor's context-parallel core), PP=2 (each
teacher's 4 layers split 2 + 2 over the actor's stages: the Qwen3.5's stage 0 two linear-attention
layers, its stage 1 a linear and the full-attention one) and PP=2xVPP=2 (one teacher layer per
virtual chunk), each world spawned once. Each teacher's log-probs at the scored ids (and not the
other's), the first step's OPD loss and every gradient against dense float64, the Hugging Face
teachers' log-softmax over their real 64 ids (their padding rows get no mass: the negative control
scores them and misses)."""
from __future__ import annotations

import sys

import pytest
import torch

from megatron_rl_patches.testing import layouts

pytestmark = pytest.mark.slime

WEIGHTS = (0.3, 0.4, 0.3)  # the snapshot teacher, qwen3, qwen3_5
SEEDS = {"qwen3": 12, "qwen3_5": 12}
# the gated delta nets' float32 build alone (unpacked) is about 1.5e-4 from float64 (log-probs reach -21)
TOL = {"qwen3": 1e-4, "qwen3_5": 3e-4}
OTHER = dict(hidden_size=48, num_hidden_layers=4, intermediate_size=64, vocab_size=64, max_position_embeddings=64)
# (pipeline, context, virtual chunks) -> layout marks; cp2: each rank its zigzag rows of every sample,
# the Qwen3.5's gated delta nets exchanging rows over the context-parallel group
LAYOUTS = {"pp1": ((1, 1, None), ("thd",)), "pp2": ((2, 1, None), ("pp2", "thd")),
           "pp2vpp2": ((2, 1, 2), ("pp2", "vpp2", "thd")), "cp2": ((1, 2, None), ("cp2-zigzag", "thd"))}
# per rank, each teacher's layers per model chunk (the teachers in SEEDS' order)
HF_LAYERS = {"pp1": [[[1, 2, 3, 4]] * 2], "pp2": [[[1, 2]] * 2, [[3, 4]] * 2],
             "pp2vpp2": [[[1], [3]] * 2, [[2], [4]] * 2], "cp2": [[[1, 2, 3, 4]] * 2] * 2}


@pytest.fixture(scope="module", params=[pytest.param(name, marks=layouts.mark(*LAYOUTS[name][1]))
                                        for name in LAYOUTS])
def world(request, tmp_path_factory):
    if "slime_standins" not in sys.modules:  # the lane's conftest installs them where slime's source is found
        pytest.skip("slime is not importable; run `make test-slime SLIME=... MEGATRON_LM=...`")
    import slime_ranks  # the lane folder is on sys.path (conftest)

    from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, transformers_layout, write_tiny_checkpoint
    from megatron_rl_patches.testing.multirank import run_multirank

    root = tmp_path_factory.mktemp("hf")
    paths = []
    for kind, seed in SEEDS.items():  # Qwen3.5 nested as transformers writes it
        write_tiny_checkpoint(root / kind, transformers_layout(tiny_hf_config(kind, **OTHER)), seed=seed)
        paths.append(str(root / kind))
    (pipeline, context, virtual), _ = LAYOUTS[request.param]
    return request.param, virtual, paths, run_multirank(slime_ranks.opd_train_actor, pipeline * context, pipeline,
                                                        context, 1, virtual, ",".join(paths), (), 1, None, 1,
                                                        ",".join(map(str, WEIGHTS)), timeout=300)


def _whole_teacher_logprobs(ranks: list[dict], context: int) -> list[torch.Tensor]:
    """Per sample, the last stage's [teachers, R, k] scores of the whole response (at CP each rank
    holds its zigzag rows: put together as kit.whole_ids puts the ids)."""
    import slime_kit as kit

    if context == 1:
        return ranks[-1]["teacher_logprobs"]
    teachers, _, k = ranks[-1]["teacher_logprobs"][0].shape
    pieces = [{"ids": [t.permute(1, 0, 2).reshape(t.shape[1], teachers * k) for t in r["teacher_logprobs"]],
               "rows": r["rows"]} for r in ranks[-context:]]
    return [w.reshape(w.shape[0], teachers, -1).permute(1, 0, 2) for w in kit.whole_ids(pieces, context, 1)]


def test_train_actor_with_a_snapshot_a_qwen3_and_a_qwen3_5_teacher_equals_dense_float64(slime_cpu, world):
    import slime_kit as kit
    import slime_ranks

    from megatron_rl_patches.integrations.slime import opd as slime_opd

    layout, virtual, paths, ranks = world
    context = LAYOUTS[layout][0][1]
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
        real = [kit.hf_teacher_logps(path, data, slime_ranks.TEMPERATURE, kit.VOCAB) for path in paths]
        padded = [kit.hf_teacher_logps(path, data, slime_ranks.TEMPERATURE, None) for path in paths]  # the control
        students = kit.response_logps(student, data, slime_ranks.TEMPERATURE)
        ids = kit.whole_ids(ranks, context, 1)
        expected = kit.dense_opd_loss(students, [snapshot, *real], data, ids, WEIGHTS)
        with torch.no_grad():
            unmasked = kit.dense_opd_loss(students, [snapshot, *padded], data, ids, WEIGHTS)
        expected.backward()

    def scored_error(index: int, reference: list[torch.Tensor]) -> float:  # teacher `index`'s scores vs it
        return max((scored[index].double() - logp.gather(-1, sample_ids)).abs().max().item()
                   for scored, logp, sample_ids in zip(_whole_teacher_logprobs(ranks, context), reference, ids))

    # teacher 0: the snapshot; each Hugging Face teacher against its own reference, then the other's
    errors = {kind: scored_error(index, real[index - 1]) for index, kind in enumerate(SEEDS, 1)}
    swapped = {kind: scored_error(index, real[index % len(real)]) for index, kind in enumerate(SEEDS, 1)}
    (losses,) = last["losses"]
    loss_error = abs(float(losses["opd_topk_loss"]) - float(expected))
    grad_error = max((grads[name].double() - p.grad).abs().max().item() for name, p in student.named_parameters())
    per_family = ", ".join(f"{kind} {error:.1e}" for kind, error in errors.items())
    print(f"slime_opd train_actor {layout}, a snapshot, a qwen3 and a qwen3_5 teacher of another size vs dense "
          f"float64: teacher log-probs max |Δ| {per_family}; loss {float(expected):.6f}, |Δloss| {loss_error:.2e}, "
          f"max |Δgrad| {grad_error:.2e}; padding rows scored: |Δloss| {abs(float(unmasked) - float(expected)):.2e}")
    for kind, error in errors.items():
        assert error <= TOL[kind], kind
        assert swapped[kind] > 100 * TOL[kind], kind  # the other teacher's log-probs are told apart
    assert loss_error <= 1e-5 * max(1.0, abs(float(expected)))
    assert abs(float(losses["opd_topk_loss"]) - float(unmasked)) > 100 * max(loss_error, 1e-7)
    for name, p in student.named_parameters():
        torch.testing.assert_close(grads[name].double(), p.grad, rtol=1e-4, atol=1e-6, msg=name)
