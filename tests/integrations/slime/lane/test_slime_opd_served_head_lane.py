"""slime_opd with a served teacher's head (`http://host:port;engine=vllm;head=DIR`): a real vLLM
pooling server (its CPU build, MRP_VLLM_PYTHON) sends the teacher's final hidden states, the
trainer projects them through DIR's output layer, through slime 624b824a's real
`MegatronTrainRayActor.train_actor` with a snapshot teacher beside it, at one rank and TP=2: the
student's own ids and the union (MEGATRON_RL_PATCHES_OPD_IDS_FROM=student / union, refused for a
served teacher without a head) and its own top-k (teacher) at slime's --rollout-temperature 0.8
(a served teacher without a head: 1 only); the first step's OPD loss and every gradient against
dense float64 (the served checkpoint built alone in float64). Without MRP_VLLM_PYTHON the test
skips naming it (the slime lane is outside `make test`)."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.testing import layouts
from tests.integrations.slime.lane.served_qwen3_kit import VLLM_PYTHON, VOCAB, served_checkpoint

pytestmark = pytest.mark.slime

WEIGHTS = (0.3, 0.7)  # slime_ranks.OPD_ENV's: the served teacher, the snapshot
TEMPERATURE = 0.8
SP = layouts.BY_MARKER["sp"].megatron_lm_args
# name: ((pipeline, context, tensor, slime's extra flags, IDS_FROM), the layout's markers)
LAYOUTS = {"pp1-student": ((1, 1, 1, (), "student"), ("thd",)),
           "tp2sp-student": ((1, 1, 2, SP, "student"), ("tp2", "sp")),
           "pp1-union": ((1, 1, 1, (), "union"), ("thd",)),
           "tp2sp-teacher": ((1, 1, 2, SP, "teacher"), ("tp2", "sp")),
           "pp2-student": ((2, 1, 1, (), "student"), ("pp2", "thd")),
           "cp2-union": ((1, 2, 1, (), "union"), ("cp2-zigzag", "thd")),
           # the served teacher second: it scores the union the snapshot teacher made (ids and mask)
           "pp1-union-second": ((1, 1, 1, (), "union"), ("thd",))}
# vLLM's pooling runner serving a causal LM's final hidden states per token
POOLING = ("--runner", "pooling", "--convert", "embed", "--pooler-config", '{"task": "token_embed"}')


@pytest.fixture(scope="module")
def pooled(tmp_path_factory):
    from megatron_rl_patches.testing.vllm_server import vllm_server

    root = tmp_path_factory.mktemp("pooled")
    directory = served_checkpoint(root)
    with vllm_server(VLLM_PYTHON, directory, root / "vllm.log", max_model_len=256, extra=POOLING) as server:
        yield server.url, str(directory)


@pytest.mark.parametrize("layout", [pytest.param(name, marks=layouts.mark(*LAYOUTS[name][1])) for name in LAYOUTS])
def test_train_actor_with_a_served_head_equals_dense_float64(slime_cpu, pooled, layout):
    import slime_kit as kit
    import slime_ranks

    from megatron_rl_patches.integrations.slime import opd as slime_opd
    from megatron_rl_patches.testing.multirank import run_multirank

    url, directory = pooled
    pipeline, context, tensor, flags, ids_from = LAYOUTS[layout][0]
    second = layout.endswith("-second")
    entry = f"{url};engine=vllm;head={directory}"
    served = {"entries": f"teacher-a,{entry}" if second else f"{entry},teacher-a", "student": directory,
              "ids_from": ids_from, "temperature": str(TEMPERATURE)}
    per_stage = context * tensor
    ranks = run_multirank(slime_ranks.opd_train_actor, pipeline * per_stage, pipeline, context, tensor, None, None,
                          flags, 1, None, 1, None, None, served, timeout=600)
    keys = [slime_opd.IDS, slime_opd.TEACHER_LOGPROBS, slime_opd.TEACHER_TAILS]
    for rank in ranks[-per_stage:]:  # the last stage's ranks hold the fields
        assert rank["keys"] == sorted(keys + ([slime_opd.IDS_MASK] if ids_from == "union" else []))
    stages = [ranks[first:first + tensor] for first in range(0, len(ranks), per_stage)]

    def whole(field, tag=None):
        return kit.whole_stages([kit.unsplit([r[field] if tag is None else r[field][tag] for r in shards],
                                             shards[0]["split"]) for shards in stages])

    def whole_rows(field):  # a per-row field of the last stage's context-parallel ranks, whole per sample
        return kit.whole_ids([{**rank, "ids": rank[field]} for rank in ranks], context, tensor)

    snapshot_tag = "opd_teacher_0" if second else "opd_teacher_1"
    states, grads = {tag: whole("states", tag) for tag in ("actor", snapshot_tag)}, whole("grads")
    with kit.slime_session("--loss-type", "custom_loss", "--custom-loss-function-path", slime_ranks.OPD_LOSS) as args:
        names = [name for name, _ in kit.provider_func(args)().named_parameters()]
        data = kit.rollout(0)
        ids = kit.whole_ids(ranks, context, tensor)
        masks = whole_rows("ids_mask") if ids_from == "union" else None
        teacher = kit.hf_teacher_logps(directory, data, TEMPERATURE, VOCAB)
        student = kit.float64_copy(args, [states["actor"][name] for name in names])
        dense_student = kit.response_logps(student, data, TEMPERATURE)
        k = int(slime_ranks.OPD_ENV["K"])
        with torch.no_grad():
            other = kit.response_logps(kit.float64_copy(args, [states[snapshot_tag][n] for n in names]), data,
                                       TEMPERATURE)
        chooser = teacher if ids_from == "teacher" else dense_student  # a union: the student's ids first
        for sample_ids, logp in zip(ids, chooser):  # whose own top-k the step's ids are, ties aside
            assert (sample_ids[:, :k].sort(-1).values == logp.topk(k).indices.sort(-1).values).float().mean() > 0.9
        teachers = [other, teacher] if second else [teacher, other]
        expected = kit.dense_opd_loss(dense_student, teachers, data, ids, WEIGHTS, masks)
        expected.backward()
    served_values = whole_rows("second_logprobs" if second else "served_logprobs")  # the served teacher's [R, k]
    real = masks or [torch.ones_like(i, dtype=torch.bool) for i in ids]
    value_error = max((v.double() - t.gather(-1, i.clamp(min=0)))[m].abs().max().item()
                      for v, t, i, m in zip(served_values, teacher, ids, real))
    (losses,) = ranks[-1]["losses"]
    loss_error = abs(float(losses["opd_topk_loss"]) - float(expected))
    grad_error = max((grads[name].double() - p.grad).abs().max().item() for name, p in student.named_parameters())
    print(f"slime_opd train_actor {layout} with a served head ({ids_from} ids, T={TEMPERATURE}) vs dense float64: "
          f"loss {float(expected):.6f}, |Δloss| {loss_error:.2e}, max |Δteacher logp| {value_error:.2e}, "
          f"max |Δgrad| {grad_error:.2e}")
    assert value_error <= 1e-5
    assert loss_error <= 1e-5 * max(1.0, abs(float(expected)))
    for name, p in student.named_parameters():
        torch.testing.assert_close(grads[name].double(), p.grad, rtol=1e-4, atol=1e-6, msg=name)


# full-vocabulary OPD (MEGATRON_RL_PATCHES_OPD_K=vocab) with the served head first, the snapshot second:
# name: (pipeline, context, tensor, slime's extra flags), the layout's markers
VOCAB_LAYOUTS = {"pp1-vocab": ((1, 1, 1, ()), ("thd",)), "tp2sp-vocab": ((1, 1, 2, SP), ("tp2", "sp")),
                 "pp2-vocab": ((2, 1, 1, ()), ("pp2", "thd")), "cp2-vocab": ((1, 2, 1, ()), ("cp2-zigzag", "thd"))}


@pytest.mark.parametrize("layout", [pytest.param(name, marks=layouts.mark(*VOCAB_LAYOUTS[name][1]))
                                    for name in VOCAB_LAYOUTS])
def test_train_actor_full_vocabulary_with_a_served_head_equals_dense_float64(slime_cpu, pooled, layout):
    """K=vocab: the served teacher's hidden states through its head and the snapshot's, mixed 0.3 /
    0.7, forward KL over the whole vocabulary at --rollout-temperature 0.8; the loss and every
    gradient against dense float64; the served checkpoint's rows shifted by one must not match."""
    import slime_kit as kit
    import slime_ranks

    from megatron_rl_patches.integrations.megatron.opd.topk_request import VOCAB_KEYS
    from megatron_rl_patches.testing.multirank import run_multirank

    url, directory = pooled
    pipeline, context, tensor, flags = VOCAB_LAYOUTS[layout][0]
    served = {"entries": f"{url};engine=vllm;head={directory},teacher-a", "student": directory,
              "ids_from": "student", "temperature": str(TEMPERATURE)}
    per_stage = context * tensor
    ranks = run_multirank(slime_ranks.opd_train_actor, pipeline * per_stage, pipeline, context, tensor, None, None,
                          flags, 1, None, 1, None, None, served, {"K": "vocab"}, timeout=600)
    for rank in ranks[-per_stage:]:  # the last stage's ranks hold the fields
        assert rank["keys"] == sorted(VOCAB_KEYS)
    stages = [ranks[first:first + tensor] for first in range(0, len(ranks), per_stage)]

    def whole(field, tag=None):
        return kit.whole_stages([kit.unsplit([r[field] if tag is None else r[field][tag] for r in shards],
                                             shards[0]["split"]) for shards in stages])

    states, grads = {tag: whole("states", tag) for tag in ("actor", "opd_teacher_1")}, whole("grads")
    with kit.slime_session("--loss-type", "custom_loss", "--custom-loss-function-path", slime_ranks.OPD_LOSS) as args:
        names = [name for name, _ in kit.provider_func(args)().named_parameters()]
        data = kit.rollout(0)
        teacher = kit.hf_teacher_logps(directory, data, TEMPERATURE, VOCAB)
        student = kit.float64_copy(args, [states["actor"][name] for name in names])
        with torch.no_grad():
            other = kit.response_logps(kit.float64_copy(args, [states["opd_teacher_1"][n] for n in names]), data,
                                       TEMPERATURE)
        dense_student = kit.response_logps(student, data, TEMPERATURE)
        expected = kit.dense_vocab_loss(dense_student, [teacher, other], data, WEIGHTS)
        expected.backward()
        with torch.no_grad():
            misaligned = kit.dense_vocab_loss(dense_student, [[t.roll(1, dims=0) for t in teacher], other], data,
                                              WEIGHTS)
    (losses,) = ranks[-1]["losses"]
    measured = float(losses["opd_vocab_loss"])
    loss_error = abs(measured - float(expected))
    grad_error = max((grads[name].double() - p.grad).abs().max().item() for name, p in student.named_parameters())
    print(f"slime_opd K=vocab train_actor {layout} with a served head (T={TEMPERATURE}) vs dense float64: loss "
          f"{float(expected):.6f}, |Δloss| {loss_error:.2e}, max |Δgrad| {grad_error:.2e}; the served rows shifted: "
          f"|Δloss| {abs(measured - float(misaligned)):.2e}")
    tolerance = 1e-5 * max(1.0, abs(float(expected)))
    assert loss_error <= tolerance
    # the negative control: a misaligned reference fails the same bound, by a wide margin
    assert abs(measured - float(misaligned)) > 10 * tolerance
    for name, p in student.named_parameters():
        torch.testing.assert_close(grads[name].double(), p.grad, rtol=1e-4, atol=1e-6, msg=name)
