"""Full-vocabulary OPD (MEGATRON_RL_PATCHES_OPD_K=vocab) through slime 624b824a's real
`MegatronTrainRayActor.train_actor`: two snapshot teachers mixed 0.3 / 0.7, forward KL over the
whole vocabulary from the teachers' final hidden states, at one rank, TP=2 with SP, PP=2, CP=2
zigzag and CP=2 allgather. The first step's OPD loss and every gradient against dense float64
(the ranks' weights put back together); a reference with the teachers' rows shifted by one (the
misalignment a wrong row placement gives) must not match."""
from __future__ import annotations

import sys

import pytest
import torch

from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.layouts import BY_MARKER

pytestmark = pytest.mark.slime

WEIGHTS = (0.3, 0.7)
TEMPERATURE = 0.8  # slime_ranks.TEMPERATURE: the rollout's
LOSS = "megatron_rl_patches.integrations.slime_opd.topk_opd_policy_loss"  # slime_ranks.OPD_LOSS
VOCAB_ENV = {"K": "vocab"}
# name: (pipeline, context, tensor, slime's extra flags), the layout's markers
LAYOUTS = {"pp1": ((1, 1, 1, ()), ("thd",)),
           "tp2sp": ((1, 1, 2, BY_MARKER["sp"].megatron_lm_args), ("tp2", "sp", "thd")),
           "pp2": ((2, 1, 1, ()), ("pp2", "thd")),
           "cp2": ((1, 2, 1, ()), ("cp2-zigzag", "thd")),
           "cp2ag": ((1, 2, 1, BY_MARKER["cp2-allgather"].megatron_lm_args), ("cp2-allgather", "thd"))}


def shifted(per_sample: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each sample's rows moved down by one (the negative control's misalignment)."""
    return [rows.roll(1, dims=0) for rows in per_sample]


@pytest.fixture(scope="module", params=[pytest.param(name, marks=layouts.mark(*LAYOUTS[name][1])) for name in LAYOUTS])
def world(request):
    if "slime_standins" not in sys.modules:  # the lane's conftest installs them where slime's source is found
        pytest.skip("slime is not importable; run `make test-slime SLIME=... MEGATRON_LM=...`")
    import slime_ranks  # the lane folder is on sys.path (conftest)

    from megatron_rl_patches.testing.multirank import run_multirank

    pipeline, context, tensor, flags = LAYOUTS[request.param][0]
    ranks = run_multirank(slime_ranks.opd_train_actor, pipeline * context * tensor, pipeline, context, tensor, None,
                          None, flags, 1, None, 1, None, None, None, VOCAB_ENV, timeout=300)
    return (pipeline, context, tensor), flags, ranks


def test_train_actor_full_vocabulary_equals_dense_float64(slime_cpu, world):
    import slime_kit as kit
    import slime_ranks

    from megatron_rl_patches.integrations.megatron.opd.topk_request import VOCAB_KEYS

    (pipeline, context, tensor), flags, ranks = world
    per_stage = context * tensor
    for rank in ranks[:-per_stage]:  # the teachers' fields live on the last stage only
        assert rank["keys"] == [] and rank["losses"] is None
    for rank in ranks[-per_stage:]:
        assert rank["keys"] == sorted(VOCAB_KEYS)
    stages = [ranks[first:first + tensor] for first in range(0, len(ranks), per_stage)]

    def whole(field, tag=None):
        return kit.whole_stages([kit.unsplit([r[field] if tag is None else r[field][tag] for r in shards],
                                             shards[0]["split"]) for shards in stages])

    states, grads = {tag: whole("states", tag) for tag in ("actor", "opd_teacher_0", "opd_teacher_1")}, whole("grads")
    nope = layouts.NOPE_ARGS
    with kit.slime_session("--loss-type", "custom_loss", "--custom-loss-function-path", slime_ranks.OPD_LOSS,
                           *(nope if nope[0] in flags else ())) as args:  # the model's positions
        names = [name for name, _ in kit.provider_func(args)().named_parameters()]
        data = kit.rollout(0)
        student = kit.float64_copy(args, [states["actor"][name] for name in names])
        with torch.no_grad():
            teachers = [kit.response_logps(kit.float64_copy(args, [states[tag][n] for n in names]), data, TEMPERATURE)
                        for tag in ("opd_teacher_0", "opd_teacher_1")]
        expected = kit.dense_vocab_loss(kit.response_logps(student, data, TEMPERATURE), teachers, data, WEIGHTS)
        expected.backward()
        with torch.no_grad():
            misaligned = kit.dense_vocab_loss(kit.response_logps(student, data, TEMPERATURE),
                                          [shifted(t) for t in teachers], data, WEIGHTS)
    (losses,) = ranks[-1]["losses"]
    measured = float(losses["opd_vocab_loss"])
    loss_error = abs(measured - float(expected))
    grad_error = max((grads[name].double() - p.grad).abs().max().item() for name, p in student.named_parameters())
    print(f"slime_opd K=vocab train_actor pp{pipeline} cp{context} tp{tensor} vs dense float64: loss "
          f"{float(expected):.6f}, |Δloss| {loss_error:.2e}, max |Δgrad| {grad_error:.2e}; shifted teacher rows: "
          f"|Δloss| {abs(measured - float(misaligned)):.2e}")
    tolerance = 1e-5 * max(1.0, abs(float(expected)))
    assert loss_error <= tolerance
    # the negative control: a misaligned reference fails the same bound, by a wide margin
    assert abs(measured - float(misaligned)) > 10 * tolerance
    for name, p in student.named_parameters():
        torch.testing.assert_close(grads[name].double(), p.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def wide_stages():
    if "slime_standins" not in sys.modules:
        pytest.skip("slime is not importable; run `make test-slime SLIME=... MEGATRON_LM=...`")
    import tempfile

    import slime_kit as kit
    import slime_ranks
    import slime_standins

    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu
    from megatron_rl_patches.testing.multirank import run_multirank

    with tempfile.TemporaryDirectory() as tmp:
        slime_standins.cpu_accelerator()
        with megatron_on_cpu(), kit.slime_session() as args:  # saved at one rank, loaded at PP=2 (resharded)
            slime_ranks.save_wide_teacher(args, f"{tmp}/wide")
        yield run_multirank(slime_ranks.opd_train_actor, 2, 2, 1, 1, None, None, (), 1, f"{tmp}/wide", 1, None,
                            None, None, VOCAB_ENV, timeout=300)


@pytest.mark.parametrize("layout", [pytest.param("pp2", marks=layouts.mark("pp2", "thd"))])
def test_a_separate_teacher_of_another_hidden_size_at_pp2_equals_dense_float64(slime_cpu, wide_stages, layout):
    """K=vocab with a snapshot and a separate model of another hidden size and depth
    (`PATH@slime_ranks:wide_teacher`, H 48 beside the student's 32) on the actor's pipeline split:
    its hidden states and its own output weight, against dense float64."""
    import slime_kit as kit
    import slime_ranks

    first, last = wide_stages
    assert first["losses"] is None and first["keys"] == []

    def whole(tag):
        return kit.whole_stages([stage["states"][tag] for stage in wide_stages])

    states, grads = {tag: whole(tag) for tag in ("actor", "opd_teacher_0", "opd_teacher_1")}, \
        kit.whole_stages([stage["grads"] for stage in wide_stages])
    with kit.slime_session("--loss-type", "custom_loss", "--custom-loss-function-path", slime_ranks.OPD_LOSS) as args:
        names = [name for name, _ in kit.provider_func(args)().named_parameters()]
        data = kit.rollout(0)
        student = kit.float64_copy(args, [states["actor"][name] for name in names])
        wide = kit.provider_func(args)(config=slime_ranks.wide_config(args)).double()
        with torch.no_grad():
            for name, p in wide.named_parameters():
                p.copy_(states["opd_teacher_1"][name])
            teachers = [kit.response_logps(kit.float64_copy(args, [states["opd_teacher_0"][n] for n in names]), data,
                                           TEMPERATURE), kit.response_logps(wide, data, TEMPERATURE)]
        dense_student = kit.response_logps(student, data, TEMPERATURE)
        expected = kit.dense_vocab_loss(dense_student, teachers, data, WEIGHTS)
        expected.backward()
        with torch.no_grad():
            misaligned = kit.dense_vocab_loss(dense_student, [teachers[0], shifted(teachers[1])], data, WEIGHTS)
    (losses,) = last["losses"]
    measured = float(losses["opd_vocab_loss"])
    loss_error = abs(measured - float(expected))
    grad_error = max((grads[name].double() - p.grad).abs().max().item() for name, p in student.named_parameters())
    print(f"slime_opd K=vocab train_actor {layout} with a separate teacher of hidden size 48 vs dense float64: loss "
          f"{float(expected):.6f}, |Δloss| {loss_error:.2e}, max |Δgrad| {grad_error:.2e}; its rows shifted: "
          f"|Δloss| {abs(measured - float(misaligned)):.2e}")
    tolerance = 1e-5 * max(1.0, abs(float(expected)))
    assert loss_error <= tolerance
    assert abs(measured - float(misaligned)) > 10 * tolerance  # the negative control
    for name, p in student.named_parameters():
        torch.testing.assert_close(grads[name].double(), p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_no_vocabulary_wide_tensor_in_the_teachers_passes_nor_the_step(slime_cpu, monkeypatch):
    """One rank, jsd: the teachers' passes keep [R, H] hidden states per sample (no log-prob, no
    [T, V]) and the training step's largest vocabulary-wide tensor is one tile of
    --log-probs-chunk-size rows."""
    import math

    import slime_kit as kit
    import slime_standins
    from slime.backends.megatron_utils import model as slime_model

    import megatron_rl_patches
    from megatron_rl_patches.integrations.megatron.opd.opd_settings import opd_settings
    from megatron_rl_patches.integrations.megatron.opd.topk_request import TEACHER_HIDDEN
    from megatron_rl_patches.integrations.slime import opd as slime_opd
    from megatron_rl_patches.testing.vocab_watch import VocabWideTensors

    slime_standins.cpu_pinned_memory(monkeypatch)
    values = {"TEACHERS": "teacher-a,teacher-b", "WEIGHTS": "0.3,0.7", "K": "vocab", "DIVERGENCE": "jsd",
              "POLICY_WEIGHT": "0", "COEF": "1"}
    for name, value in values.items():
        monkeypatch.setenv(f"MEGATRON_RL_PATCHES_OPD_{name}", value)
    megatron_rl_patches.apply(only=["slime_fused", "gpt_output_processor", "slime_opd"])
    with kit.slime_session("--loss-type", "custom_loss", "--custom-loss-function-path", LOSS,
                           rollout_temperature=TEMPERATURE, log_probs_chunk_size=4) as args:
        model, optimizer, scheduler = kit.build(args)
        actor = kit.actor(args, model, {"teacher-a": 1, "teacher-b": 2}, monkeypatch)
        setattr(actor, slime_opd.ATTRIBUTE, slime_opd.load_teachers(actor, opd_settings()))
        data = kit.rollout(0, kit.log_probs(args, model, kit.rollout(0))["log_probs"])
        data["num_microbatches"] = [len(data["micro_batch_indices"])]
        with VocabWideTensors(vocab=kit.VOCAB) as scoring:
            slime_opd.score_teachers(actor, data, opd_settings())
        assert actor._active_model_tag == "actor"
        hidden = args.hidden_size
        assert [[tuple(t.shape) for t in sample] for sample in data[TEACHER_HIDDEN]] == \
            [[(r, hidden), (r, hidden)] for r in kit.RESPONSES]
        for chunk in model:
            chunk.train()
        with VocabWideTensors(vocab=kit.VOCAB) as step:
            losses, _ = slime_model.train_one_step(args, 0, 0, kit.iterators(data), model, optimizer, scheduler, 2, 4)
    assert scoring.largest_bytes == 0, scoring.as_dict()  # the passes form no vocabulary-wide tensor at all
    assert step.largest_bytes and math.prod(step.largest_shape[:-1]) <= 4, step.as_dict()  # tiles of 4 rows
    assert math.isfinite(float(losses["opd_vocab_loss"])) and float(losses["opd_vocab_loss"]) > 0
