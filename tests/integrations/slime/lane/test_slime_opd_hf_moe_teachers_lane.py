"""slime_opd through slime 624b824a's real `MegatronTrainRayActor.train_actor` with Hugging Face
teachers of the mixture-of-experts families, each of another size than the student and its
tokenizer (vocab 64): a glm4_moe teacher (issue 50: sigmoid routing with expert bias in groups,
shared expert, a dense first layer, partial RoPE), a deepseek_v3 teacher (issue 51: multi-latent
attention on top of the same MoE), a Qwen3.5-MoE teacher (issue 58: the vision-language wrapper's
layout as transformers writes it, three gated-delta-net layers and one gated full-attention layer,
experts with a gated shared expert on every layer) and a Qwen3-Next teacher (issue 58: the same
hybrid, its own layout), all hidden 48 x 4 layers against the actor's 32 x 2, beside a snapshot
teacher, in one mixture. The actor runs a custom local spec (`--spec slime_kit packed_spec`: the
kit's packed CPU attention), so the teachers' full-attention layers run its core (issue 50, item
7; the linear-attention layers keep their own module). One world per layout, every family in it:
one rank, TP=2 (MLA and the gated delta nets' heads split over tensor ranks too) and EP=2 (an MoE
actor; glm4_moe's and deepseek_v3's 8 experts split 4 + 4, the Qwen3.5-MoE's and Qwen3-Next's 4
split 2 + 2). Checked against dense float64: each teacher's log-probs at the scored ids (and not
another teacher's: the mixture's order), the first step's OPD loss and every gradient; the
negative control scores the teachers' padding rows (vocab 64 padded to 128) and misses. Routing
seeds: the smallest gap between a chosen and a dropped expert (or group) over the rollout's tokens
(`router_margin` in transformers' forward for glm4_moe, seed 8: 2.4e-2, and deepseek_v3, seed 11:
8.4e-3; the float64 build's router logits for qwen3_5_moe, seed 1: 2.5e-2, and qwen3_next, seed 7:
2.9e-2), far from a tie. The gated delta nets' float32 build alone (unpacked) is 1.0e-4 (qwen3_5_moe)
and 9.7e-5 (qwen3_next) from float64 at these seeds (from 1e-4 to 9.5e-4 over qwen3_5_moe's seeds 0
to 7: `write_tiny_checkpoint` draws A_log and dt_bias around 1, a fast decay), hence their 3e-4."""
from __future__ import annotations

import sys

import pytest
import torch

from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.layouts import BY_MARKER

pytestmark = pytest.mark.slime

EP2 = BY_MARKER["ep2"].megatron_lm_args
OTHER = dict(hidden_size=48, num_hidden_layers=4, intermediate_size=64, vocab_size=64, max_position_embeddings=64)
SEEDS = {"glm4_moe": 8, "deepseek_v3": 11, "qwen3_5_moe": 1, "qwen3_next": 7}  # routing margins: the docstring
WEIGHTS = (0.1, 0.2, 0.3, 0.2, 0.2)  # the snapshot teacher, then the families in SEEDS' order
# the gated delta nets' float32 build alone (unpacked) is about 1e-4 from float64 (the docstring)
TOL = {"glm4_moe": 1e-4, "deepseek_v3": 1e-4, "qwen3_5_moe": 3e-4, "qwen3_next": 3e-4}
# layout -> (tensor, expert, slime's extra flags, layout marks)
LAYOUTS = {"pp1": (1, 1, (), ("thd",)), "tp2": (2, 1, (), ("tp2", "thd")), "ep2": (1, 2, EP2, ("ep2", "thd"))}


@pytest.fixture(scope="module", params=[pytest.param(name, marks=layouts.mark(*LAYOUTS[name][3]))
                                        for name in LAYOUTS])
def world(request, tmp_path_factory):
    if "slime_standins" not in sys.modules:  # the lane's conftest installs them where slime's source is found
        pytest.skip("slime is not importable; run `make test-slime SLIME=... MEGATRON_LM=...`")
    import slime_ranks  # the lane folder is on sys.path (conftest)

    from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, transformers_layout, write_tiny_checkpoint
    from megatron_rl_patches.testing.multirank import run_multirank

    root = tmp_path_factory.mktemp("hf")
    paths = []
    for kind, seed in SEEDS.items():  # Qwen3.5-MoE nested as transformers writes it; the others as they are
        write_tiny_checkpoint(root / kind, transformers_layout(tiny_hf_config(kind, **OTHER)), seed=seed)
        paths.append(str(root / kind))
    tensor, expert, flags, _ = LAYOUTS[request.param]
    ranks = run_multirank(slime_ranks.opd_train_actor, tensor * expert, 1, 1, tensor, None, ",".join(paths), flags,
                          1, None, expert, ",".join(map(str, WEIGHTS)), timeout=600)
    return request.param, paths, ranks


def _whole(ranks: list[dict], field: str, tag: str | None, tensor: int) -> dict[str, torch.Tensor]:
    """The actor's named tensors (one pipeline stage) from its ranks: tensor-parallel shards joined
    where split, experts from each expert-parallel rank (replicated ones: rank 0's)."""
    parts = [rank[field] if tag is None else rank[field][tag] for rank in ranks]
    if tensor == 1:
        return {name: value for part in reversed(parts) for name, value in part.items()}
    split = ranks[0]["split"]
    return {name: value if split[name] is None else torch.cat([part[name] for part in parts], split[name])
            for name, value in parts[0].items()}


def test_train_actor_with_four_moe_family_teachers_equals_dense_float64(slime_cpu, world):
    import slime_kit as kit
    import slime_ranks

    from megatron_rl_patches.integrations.slime import opd as slime_opd

    layout, paths, ranks = world
    tensor, expert, flags, _ = LAYOUTS[layout]
    last = ranks[-1]
    assert all(r["active"] == "actor" for r in ranks)
    assert last["keys"] == sorted([slime_opd.IDS, slime_opd.TEACHER_LOGPROBS, slime_opd.TEACHER_TAILS])
    assert [r["hf_layers"] for r in ranks] == [[[1, 2, 3, 4]] * len(SEEDS)] * len(ranks)  # each teacher whole
    states = {tag: _whole(ranks, "states", tag, tensor) for tag in ("actor", "opd_teacher_0")}
    grads = _whole(ranks, "grads", None, tensor)
    data, ids = kit.rollout(0), last["ids"]
    with kit.slime_session("--loss-type", "custom_loss", "--custom-loss-function-path", slime_ranks.OPD_LOSS,
                           *(EP2[:4] + EP2[6:] if expert > 1 else ()),  # the whole actor: all experts on one rank
                           **(slime_ranks.MOE_VALUES if expert > 1 else {})) as args:
        student, snapshot = kit.student_and_snapshot(args, states, data, slime_ranks.TEMPERATURE)
        assert sorted(grads) == sorted(name for name, _ in student.named_parameters())
        teachers = [(kit.hf_teacher_logps(path, data, slime_ranks.TEMPERATURE, kit.VOCAB),
                     kit.hf_teacher_logps(path, data, slime_ranks.TEMPERATURE, None)) for path in paths]
        students = kit.response_logps(student, data, slime_ranks.TEMPERATURE)
        expected = kit.dense_opd_loss(students, [snapshot, *(real for real, _ in teachers)], data, ids, WEIGHTS)
        with torch.no_grad():
            unmasked = kit.dense_opd_loss(students, [snapshot, *(padded for _, padded in teachers)], data, ids,
                                          WEIGHTS)
        expected.backward()
    def scored_error(index: int, real: list[torch.Tensor]) -> float:  # teacher `index`'s scores vs `real`
        return max((scored[index].double() - logp.gather(-1, sample_ids)).abs().max().item()
                   for scored, logp, sample_ids in zip(last["teacher_logprobs"], real, ids))

    # teacher 0: the snapshot; each family against its own reference, then against the next one's
    family_errors = {kind: scored_error(index, real) for index, (kind, (real, _)) in enumerate(zip(SEEDS, teachers), 1)}
    swapped = {kind: scored_error(index, teachers[index % len(teachers)][0]) for index, kind in enumerate(SEEDS, 1)}
    (losses,) = last["losses"]
    loss_error = abs(float(losses["opd_topk_loss"]) - float(expected))
    grad_error = max((grads[name].double() - p.grad).abs().max().item() for name, p in student.named_parameters())
    per_family = ", ".join(f"{kind} {error:.1e}" for kind, error in family_errors.items())
    print(f"slime_opd train_actor {layout}, a snapshot and four MoE teachers of another size vs "
          f"dense float64: teacher log-probs max |Δ| {per_family}; loss {float(expected):.6f}, |Δloss| "
          f"{loss_error:.2e}, max |Δgrad| {grad_error:.2e}; padding rows scored: |Δloss| "
          f"{abs(float(unmasked) - float(expected)):.2e}")
    for kind, error in family_errors.items():
        assert error <= TOL[kind], kind
        assert swapped[kind] > 100 * TOL[kind], kind  # another teacher's log-probs are told apart
    assert loss_error <= 1e-5 * max(1.0, abs(float(expected)))
    assert abs(float(losses["opd_topk_loss"]) - float(unmasked)) > 100 * max(loss_error, 1e-7)
    for name, p in student.named_parameters():
        torch.testing.assert_close(grads[name].double(), p.grad, rtol=1e-4, atol=1e-6, msg=name)
