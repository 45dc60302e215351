"""The served teachers of another tokenizer in slime's lane (`test_slime_opd_served_cross_lane.py`:
top-k replies, buckets folded; `test_slime_opd_served_head_cross_lane.py`: hidden states through
the head, every bucket whole): the pair they serve (`serve_pair`: the student on part 1's
SentencePiece-style BPE without a dummy prefix, the teacher a tiny Qwen3 on the same BPE with one,
behind a real vLLM server) and one step of slime's real `train_actor` against the cross lane's
float64 reference (`train_and_compare`)."""
from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from tests.cross_tokenizer import conftest as tokenizer_fixtures
from tests.integrations.slime.lane import test_slime_opd_cross_tokenizer_lane as cross_lane

VLLM_PYTHON = os.environ.get("MRP_VLLM_PYTHON", "")


@contextlib.contextmanager
def serve_pair(tmp_path_factory, name: str, **server: object) -> Iterator[tuple[str, str, str]]:
    """The student's --hf-checkpoint (its tokenizer.json) and the served teacher: a tiny Qwen3 of
    the dummy-prefix tokenizer's size, its tokenizer beside it, behind a vLLM server (`server`:
    `vllm_server`'s options); (url, student directory, teacher directory)."""
    if not VLLM_PYTHON:
        pytest.skip("MRP_VLLM_PYTHON names vLLM's interpreter (the served lane's, .lanes/vllm/bin/python): unset")
    if "slime_standins" not in sys.modules:
        pytest.skip("slime is not importable; run `make test-slime SLIME=... MEGATRON_LM=...`")
    from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, transformers_layout, write_tiny_checkpoint
    from megatron_rl_patches.testing.vllm_server import vllm_server

    root = tmp_path_factory.mktemp(name)
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
    with vllm_server(VLLM_PYTHON, teacher, root / "vllm.log", max_model_len=256, **server) as running:  # type: ignore[arg-type]
        yield running.url, str(student), str(teacher)


@dataclass(frozen=True)
class Compared:
    """One step against float64: the reference loss the run is held to (`expected`), the other
    bucket rule's (`other`: unfolded for a folding teacher, folded for an exact one) and how many
    buckets the folding rule folds, the shifted-chunks loss, and the run's errors."""

    expected: float
    other: float
    folded: int
    shifted: float
    loss_error: float
    grad_error: float
    kl_error: float
    controls: dict[str, float] | None = None  # a privileged teacher's: its loss without its context, rolled


HINTS = ("Hint: a fox.", [5, 9, 14, 2], "Use the tool.", [30, 31])  # text (the teacher's tokenizer) or its ids


def hint_ids(own_tokenizer) -> list[torch.Tensor]:
    """`HINTS` as the teacher's ids."""
    return [torch.tensor(own_tokenizer.encode(h, add_special_tokens=False).ids if isinstance(h, str) else h)
            for h in HINTS]


def train_and_compare(served: tuple[str, str, str], spec: tuple, entry: str, *, folds: bool, label: str,
                      privileged: bool = False) -> Compared:
    """slime_opd's first step through `train_actor` at `spec` (pipeline, context, tensor, slime's
    flags) with a snapshot teacher and the served `entry`, against the float64 reference of the
    in-process teacher (`folds`: as a top-k engine gives its buckets, a bucket with a teacher id
    outside the top-k in the tail); the rollout's fields present, slime's --use-opd reverse KL,
    the loss and every gradient checked here, the figures printed after `label`. `privileged`: the
    entry reads `;context=hint`, each sample's train_metadata `HINTS[i]`, and the reference is the
    teacher's on context + its encoding of the response (the controls: without it, rolled by one)."""
    import slime_kit as kit
    import slime_ranks

    from megatron_rl_patches.cross_tokenizer import shared_strings
    from megatron_rl_patches.cross_tokenizer import teacher_passes as cross_teachers
    from megatron_rl_patches.inference.build_hf import build_inference_model_from_hf
    from megatron_rl_patches.integrations.slime import opd as slime_opd
    from megatron_rl_patches.testing.multirank import run_multirank

    url, student_dir, teacher_dir = served
    pipeline, context, tensor, flags = spec
    spm = tokenizer_fixtures.sentencepiece_like("never")
    own_tokenizer = cross_lane.snapshot_tokenizer()
    cross = {"teacher": teacher_dir, "student": student_dir, "vocab": cross_lane.STUDENT_VOCAB,
             "samples": cross_lane._samples(spm), "temperature": 1.0, "entries": f"teacher-a,{entry}"}
    per_stage = context * tensor
    ranks = run_multirank(slime_ranks.opd_train_actor, pipeline * per_stage, pipeline, context, tensor, None, None,
                          cross_lane.USE_OPD + flags, 1, None, 1, None, cross, None, None,
                          [{"hint": h} for h in HINTS] if privileged else None, timeout=600)
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
    plain = samples
    if privileged:
        from megatron_rl_patches.teachers import cross_with_context

        samples = cross_with_context(plain, hint_ids(own_tokenizer))
        rolled = cross_with_context(plain, [h.roll(1) for h in hint_ids(own_tokenizer)])
    shared = shared_strings(spm, own_tokenizer)
    assert shared.most_ids("teacher") == 2  # a byte has two teacher ids (`a`, `<0x61>`): a bucket can fold
    with kit.slime_session("--loss-type", "custom_loss", "--custom-loss-function-path", slime_ranks.OPD_LOSS,
                           "--vocab-size", str(cross_lane.STUDENT_VOCAB)) as args:
        names = [name for name, _ in kit.provider_func(args)().named_parameters()]
        student = kit.float64_copy(args, [states["actor"][name] for name in names])
        with torch.no_grad():
            same = kit.response_logps(kit.float64_copy(args, [states["opd_teacher_0"][n] for n in names]), data, 1.0)
            (teacher,) = build_inference_model_from_hf(teacher_dir, dtype=torch.float32)
            teacher = teacher.double()

            def scored(seen):
                own = {"tokens": [s.tokens for s in seen], "response_lengths": [s.response_length for s in seen]}
                return kit.response_logps(teacher, own, 1.0, getattr(teacher, "hf_vocab_size"))  # noqa: B009

            dense_teacher = scored(samples)
        students = kit.response_logps(student, data, 1.0)
        ids = kit.whole_ids(ranks, context, tensor)
        token_terms: list[torch.Tensor] = []
        folded: list[int] = []
        inputs = (students, same, dense_teacher, data, ids, samples, shared)
        expected = cross_lane.reference(*inputs, token_terms=token_terms, folded=folded if folds else None)
        with torch.no_grad():
            shifted = cross_lane.reference(*inputs, shift=True, folded=[] if folds else None)
            other = cross_lane.reference(*inputs) if folds else cross_lane.reference(*inputs, folded=folded)
            controls = None if not privileged else {
                name: float(cross_lane.reference(students, same, scored(seen), data, ids, seen, shared,
                                                  folded=[] if folds else None))
                for name, seen in (("without its context", plain), ("context rolled", rolled))}
        expected.backward()
    losses = ranks[-1]["losses"][0]
    slime_kl = kit.whole_ids([{**rank, "ids": None if rank["opd_reverse_kl"] is None else
                               [kl[:, None] for kl in rank["opd_reverse_kl"]]} for rank in ranks], context, tensor)
    compared = Compared(
        float(expected), float(other), sum(folded), float(shifted),
        loss_error=abs(float(losses["opd_topk_loss"]) - float(expected)),
        grad_error=max((grads[name].double() - p.grad).abs().max().item() for name, p in student.named_parameters()),
        kl_error=max((kl[:, 0].double() - r).abs().max().item() for kl, r in zip(slime_kl, token_terms)),
        controls=controls)
    print(f"slime_opd train_actor {label} vs float64: loss {compared.expected:.6f}, |Δloss| {compared.loss_error:.2e}, "
          f"max |Δgrad| {compared.grad_error:.2e}, slime's --use-opd reverse KL max |Δ| {compared.kl_error:.2e}; "
          f"chunks shifted by one: |Δloss| {abs(compared.shifted - compared.expected):.2e}; {compared.folded} of the "
          f"chunk starts' buckets fold in a top-k engine's reply; the other bucket rule's loss "
          f"({'unfolded' if folds else 'folded'}) differs by {abs(compared.other - compared.expected):.2e}")
    for name, value in (compared.controls or {}).items():  # a privileged teacher's controls
        print(f"  the teacher {name}: |Δloss| {abs(value - compared.expected):.2e}")
        assert abs(value - compared.expected) > 100 * max(compared.loss_error, 1e-7), name
    assert compared.kl_error < 1e-4  # the served float32 values against float64
    assert compared.loss_error <= 1e-4 * max(1.0, abs(compared.expected))
    assert abs(compared.shifted - compared.expected) > 100 * max(compared.loss_error, 1e-7)
    for name, p in student.named_parameters():
        torch.testing.assert_close(grads[name].double(), p.grad, rtol=1e-4, atol=1e-5, msg=name)
    return compared
