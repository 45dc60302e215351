"""slime_opd's Hugging Face teacher at its own layout (issue 58 item 2) in the 2-rank gloo world the
Python API's checks share (`layout_worlds.two_rank_world`, spawned once): the student at TP=1 x
DP=2, the teacher's entry `PATH;tp=2`. `load_teachers` (slime's actor stood in for by what it reads)
builds it at TeacherLayout(tp=2), each rank reading half of its bytes; each rank's samples (other
counts and lengths than the other rank's) get the 1-rank teacher's [R, k] log-probs at the student's
ids and [R] tails on slime's response rows (1e-6, relative 1e-6); a rank with no samples still takes
part; the same samples through a `PATH;pp=2` entry (TeacherLayout(pp=2)) get the same scores; an
entry the world cannot hold is refused on both ranks before anything loads, the world usable after.
megatron-core 0.13.1 (no ProcessGroupCollection) refuses by name."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.integrations.megatron.opd.topk_request import IDS, TEACHER_LOGPROBS
from tests.inference.teacher_layout.layout_worlds import close, read_shares, served, two_rank_world

pytestmark = [pytest.mark.megatron, pytest.mark.multirank, pytest.mark.slow]

VOCAB, K = 1001, 4
# per rank, each sample's (total length, response length)
SAMPLES = (((9, 4), (6, 3)), ((12, 5), (7, 2), (10, 6)))


def _rollout(rank: int) -> dict:
    """slime's rollout fields of this rank's samples, with the student's top-k ids (K distinct)."""
    gen = torch.Generator().manual_seed(10 + rank)
    tokens = [torch.randint(0, VOCAB, (total,), generator=gen) for total, _ in SAMPLES[rank]]
    ids = [(torch.randint(0, VOCAB, (response, 1), generator=gen) + 89 * torch.arange(K)) % VOCAB
           for _, response in SAMPLES[rank]]
    return {"tokens": tokens, "total_lengths": [t for t, _ in SAMPLES[rank]],
            "response_lengths": [r for _, r in SAMPLES[rank]], IDS: ids}


def _reference(chunks, data: dict) -> tuple[list, list]:
    """The teacher built whole on this rank: per sample, its log-probs at the ids and tails on the
    logits rows of the response tokens (total - R - 1 .. total - 2)."""
    from megatron_rl_patches.ops import topk_logprobs
    from megatron_rl_patches.testing.megatron_cpu import make_batch

    logps, tails = [], []
    for tokens, ids, response in zip(data["tokens"], data[IDS], data["response_lengths"]):
        total = tokens.shape[0]
        batch = make_batch(batch_size=1, seq_length=total, vocab_size=VOCAB)
        with torch.no_grad():
            logits = chunks[0](tokens[None], batch["position_ids"], batch["attention_mask"]).reshape(total, -1)
        logp, tail = topk_logprobs(logits[total - response - 1: total - 1], ids, vocab_size=VOCAB)
        logps.append(logp)
        tails.append(tail)
    return logps, tails


def opd_checks(rank: int, world_size: int, root: str) -> dict:
    import torch.distributed as dist

    from megatron_rl_patches import build_inference_model_from_hf, residency_report
    from megatron_rl_patches.integrations.megatron.opd.layout_teacher import LayoutTeacher
    from megatron_rl_patches.integrations.megatron.opd.opd_settings import RESIDENCY, TEACHERS, opd_settings
    from megatron_rl_patches.integrations.megatron.opd.opd_settings import K as K_SETTING
    from megatron_rl_patches.integrations.megatron.opd.opd_teachers import ScoringStep
    from megatron_rl_patches.integrations.slime import opd as slime_opd
    from megatron_rl_patches.testing.file_reads import FileReads
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu
    from tests.integrations.slime.tiny_actor import TinyActor

    results: dict = {}
    with megatron_on_cpu():  # the student: TP=1 x DP=2
        actor = TinyActor(num_layers=3)
        try:
            slime_opd.load_teachers(actor, opd_settings({TEACHERS: f"{root};tp=4"}))
        except ValueError as exc:
            results["tp4"] = str(exc)
        settings = opd_settings({TEACHERS: f"{root};tp=2", K_SETTING: str(K)})
        try:
            with FileReads(root) as reads:
                (teacher,) = slime_opd.load_teachers(actor, settings)
        except ValueError as exc:  # a megatron-core without ProcessGroupCollection
            results["unsupported"] = str(exc)
            dist.barrier()
            return results
        results["kind"] = type(teacher).__name__
        results["is_layout"] = isinstance(teacher, LayoutTeacher)
        results["loaded"] = actor.loaded
        results["reads"] = {name: flags.copy() for name, flags in reads.read.items()}
        data = _rollout(rank)
        step = ScoringStep(actor, data, settings, True, {}, topk_pass=None)
        scores = teacher.score(step)
        results["log_probs"], results["tails"] = scores.log_probs, scores.tails
        slime_opd.store_scores(step, [scores])
        results["stored"] = [tuple(t.shape) for t in data[TEACHER_LOGPROBS]]
        whole = build_inference_model_from_hf(root, dtype=torch.float32)  # the 1-rank teacher, per rank
        results["ref_log_probs"], results["ref_tails"] = _reference(whole, data)
        empty = {"tokens": [], "total_lengths": [], "response_lengths": [], IDS: []}
        mine = empty if rank == 0 else _rollout(rank)
        results["empty_or_not"] = teacher.score(ScoringStep(actor, mine, settings, True, {}, topk_pass=None))
        # the same samples through a `;pp=2` entry: rank 0 the teacher's first stage, rank 1 its last
        pipelined_settings = opd_settings({TEACHERS: f"{root};pp=2", K_SETTING: str(K)})
        (pipelined,) = slime_opd.load_teachers(actor, pipelined_settings)
        step = ScoringStep(actor, _rollout(rank), pipelined_settings, True, {}, topk_pass=None)
        scores = pipelined.score(step)
        results["pp2_log_probs"], results["pp2_tails"] = scores.log_probs, scores.tails
        results.update(_cross_checks(rank, root, actor))
        # MEGATRON_RL_PATCHES_OPD_RESIDENCY at a layout: `;tp=2` streamed, `;pp=2` swapped
        for entry, mode in (("tp=2", "stream"), ("pp=2", "swap")):
            moved = opd_settings({TEACHERS: f"{root};{entry}", K_SETTING: str(K), RESIDENCY: mode})
            (teacher,) = slime_opd.load_teachers(actor, moved)
            scores = teacher.score(ScoringStep(actor, _rollout(rank), moved, True, {}, topk_pass=None))
            results[f"{mode}_{entry}"] = {"log_probs": scores.log_probs, "tails": scores.tails,
                                          "report": residency_report(list(teacher)).as_dict()}
        dist.barrier()  # every rank got here: nothing above left a rank waiting
    results.update(_student_layout_checks(rank, root, whole))
    return results


def _student_layout_checks(rank: int, root: str, whole) -> dict:
    """The `;tp=2` teacher beside a student at PP=2 (rank 0 its first stage, rank 1 its last: the
    first takes part with no samples) and at CP=2 (both ranks the same samples, each its zigzag
    rows of their ids): the scores slime's rollout data keeps on each rank against the 1-rank
    teacher's, cut to those rows (`zigzag_of_whole`, which `whole_from_zigzag` — slime's rows in the
    slime lane — undoes)."""
    from megatron_rl_patches.integrations.megatron.opd.opd_settings import TEACHERS, opd_settings
    from megatron_rl_patches.integrations.megatron.opd.opd_settings import K as K_SETTING
    from megatron_rl_patches.integrations.megatron.opd.opd_teachers import ScoringStep
    from megatron_rl_patches.integrations.megatron.opd.zigzag import whole_from_zigzag, zigzag_of_whole
    from megatron_rl_patches.integrations.slime import opd as slime_opd
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu
    from tests.integrations.slime.tiny_actor import TinyActor

    settings = opd_settings({TEACHERS: f"{root};tp=2", K_SETTING: str(K)})
    data = _rollout(1)  # the same three samples on both ranks
    with megatron_on_cpu():
        want_logps, want_tails = _reference(whole, data)
    results: dict = {}
    with megatron_on_cpu(pipeline_parallel=2):
        (teacher,) = slime_opd.load_teachers(TinyActor(num_layers=3), settings)
        scores = teacher.score(ScoringStep(None, dict(data), settings, rank == 1, {}, topk_pass=None))
        results["student_pp2"] = None if scores is None else (scores.log_probs, scores.tails)
    with megatron_on_cpu(context_parallel=2):
        (teacher,) = slime_opd.load_teachers(TinyActor(num_layers=3), settings)
        lengths = (data["total_lengths"], data["response_lengths"])
        cut = {**data, IDS: zigzag_of_whole(data[IDS], *lengths)}
        results["cut_round_trip"] = all(torch.equal(a, b) for a, b in zip(whole_from_zigzag(cut[IDS], *lengths),
                                                                          data[IDS]))
        scores = teacher.score(ScoringStep(None, cut, settings, True, {}, topk_pass=None))
        results["student_cp2"] = (scores.log_probs, scores.tails)
        results["student_cp2_ref"] = tuple(zigzag_of_whole(values, *lengths) for values in (want_logps, want_tails))
    results["student_ref"] = (want_logps, want_tails)
    return results


CROSS_FIELDS = ("log_probs", "tails", "ids", "ids_mask", "alive", "log_ratio")


def _reference_pass(args, chunks, data: dict, request) -> dict:
    """opd's pass contract answered by the whole teacher on this rank, one sample at a time: the
    logits rows of the response tokens (total - R - 1 .. total - 2), its log-probs of them and its
    own top-k (request.k), or its log-probs at the given ids with their mask, and the tails."""
    from megatron_rl_patches.ops import log_probs_and_entropy, topk_ids, topk_logprobs
    from megatron_rl_patches.testing.megatron_cpu import make_batch

    (model,) = chunks
    vocab = int(model.hf_vocab_size)
    out: dict = {"log_probs": [], "topk_ids": [], "topk_log_probs": [], "tail": []}
    for i, tokens in enumerate(data["tokens"]):
        total, response = tokens.shape[0], int(data["response_lengths"][i])
        batch = make_batch(batch_size=1, seq_length=total, vocab_size=VOCAB)
        with torch.no_grad():
            logits = model(tokens[None], batch["position_ids"], batch["attention_mask"]).reshape(total, -1)
        rows = logits[total - response - 1: total - 1]
        if request.k is not None:
            out["log_probs"].append(log_probs_and_entropy(rows, tokens[total - response:], vocab_size=vocab,
                                                          with_entropy=False)[0])
            out["topk_ids"].append(topk_ids(rows, request.k, vocab_size=vocab))
        else:
            mask = data[request.mask_key][i].bool()
            logp, tail = topk_logprobs(rows, data[request.ids_key][i], ids_mask=mask, vocab_size=vocab)
            out["topk_log_probs"].append(logp)
            out["tail"].append(tail)
    return {key: values for key, values in out.items() if values}


def _cross_rollout(rank: int, tokenizer) -> dict:
    """This rank's samples in the student's tokenizer (rank 0 two, rank 1 three; prompt, response)."""
    from tests.cross_tokenizer.conftest import TEXTS

    texts = list(TEXTS.values())[: 2 + rank]
    tokens, responses = [], []
    for index, text in enumerate(texts):
        prompt = tokenizer.encode(f"Q{index}: say it", add_special_tokens=False).ids
        answer = tokenizer.encode(text, add_special_tokens=False).ids
        tokens.append(torch.tensor(prompt + answer))
        responses.append(len(answer))
    gen = torch.Generator().manual_seed(20 + rank)
    return {"tokens": tokens, "response_lengths": responses, "total_lengths": [len(t) for t in tokens],
            "loss_masks": [torch.ones(r, dtype=torch.int) for r in responses],
            "micro_batch_indices": [[i] for i in range(len(tokens))],
            "student_log_probs": [-torch.rand(r, generator=gen, dtype=torch.float64) * 3 for r in responses]}


def _cross_checks(rank: int, root: str, actor) -> dict:
    """A teacher with another tokenizer at TeacherLayout(tp=2) (`PATH;tokenizer=own;tp=2`) against
    the same teacher whole on this rank (the pass contract answered one sample at a time): every
    field of its scores (chunk-start buckets on the student's rows, tails, ids, masks, live
    buckets, log-ratio)."""
    import shutil
    import sys
    from pathlib import Path

    import torch.distributed as dist

    from megatron_rl_patches.integrations.megatron.opd import cross_passes, hf_teachers
    from megatron_rl_patches.integrations.megatron.opd.layout_teacher import LayoutTeacher
    from megatron_rl_patches.integrations.megatron.opd.opd_settings import TEACHERS, Teacher, opd_settings
    from megatron_rl_patches.integrations.megatron.opd.opd_settings import K as K_SETTING
    from megatron_rl_patches.integrations.megatron.opd.opd_teachers import ScoringStep, SeparateTeacher
    from megatron_rl_patches.integrations.slime import opd as slime_opd
    from tests.cross_tokenizer.conftest import sentencepiece_like

    standins = str(Path(__file__).resolve().parents[2] / "standins")  # slime's cp_utils (stand-in; CP=1 here)
    if standins not in sys.path:
        sys.path.insert(0, standins)
    base = Path(root).parent
    teacher_dir, student_dir = base / "cross_teacher", base / "cross_student"
    student_tokenizer = sentencepiece_like("first")
    if rank == 0:  # one copy both ranks read: the checkpoint with a tokenizer of its own, the student's
        shutil.copytree(root, teacher_dir)
        sentencepiece_like("never", nfc=True).save(str(teacher_dir / "tokenizer.json"))
        student_dir.mkdir()
        student_tokenizer.save(str(student_dir / "tokenizer.json"))
    dist.barrier()
    actor.args.hf_checkpoint = str(student_dir)
    settings = opd_settings({TEACHERS: f"{teacher_dir};tokenizer=own;tp=2", K_SETTING: str(K)})
    (teacher,) = slime_opd.load_teachers(actor, settings)
    data = _cross_rollout(rank, student_tokenizer)
    student = {"log_probs": data.pop("student_log_probs")}
    scores = teacher.score(ScoringStep(actor, data, settings, True, student, topk_pass=None))
    whole = hf_teachers.build_hf_teacher(actor.args, str(teacher_dir), None, VOCAB, None, "the whole teacher",
                                         own_tokenizer=True)
    reference = cross_passes.load_cross(actor.args, Teacher(str(teacher_dir), own_tokenizer=True),
                                        SeparateTeacher(whole))
    want = reference.score(ScoringStep(actor, data, settings, True, student, topk_pass=_reference_pass))
    return {"cross_kind": (type(teacher).__name__, type(teacher.model).__name__,
                           isinstance(teacher.model, LayoutTeacher)),
            "cross": {field: getattr(scores, field) for field in CROSS_FIELDS},
            "cross_ref": {field: getattr(want, field) for field in CROSS_FIELDS}}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return two_rank_world(tmp_path_factory, "opd")


def test_each_rank_gets_the_one_rank_teachers_topk_log_probs_and_tails_of_its_samples(world):
    served(world)
    for rank, result in enumerate(world):
        assert result["kind"] == "LayoutTeacher" and result["is_layout"] and result["loaded"] == []
        assert [tuple(t.shape) for t in result["log_probs"]] == [(r, K) for _, r in SAMPLES[rank]]
        assert result["stored"] == [(1, r, K) for _, r in SAMPLES[rank]]  # [teachers, R, k] per sample
        for key in ("log_probs", "tails"):
            for got, want in zip(result[key], result[f"ref_{key}"]):
                assert close(got, want) <= 1e-6, (rank, key, close(got, want))


def test_a_teacher_with_another_tokenizer_at_tp2_gives_the_chunk_values_of_its_whole_teacher(world):
    """`PATH;tokenizer=own;tp=2`: the teacher's two passes over its own encoding of each rank's
    samples (its own top-k, then its log-probs at the chunk-start buckets' ids) at its layout give
    every field the whole teacher gives on the student's rows: the ids, masks and live buckets
    equal, the values within 1e-6."""
    served(world)
    for rank, result in enumerate(world):
        assert result["cross_kind"] == ("CrossTokenizerTeacher", "LayoutTeacher", True)
        got, want = result["cross"], result["cross_ref"]
        assert len(got["log_probs"]) == 2 + rank
        for field in ("ids", "ids_mask", "alive"):
            assert all(torch.equal(a, b) for a, b in zip(got[field], want[field])), (rank, field)
        for field in ("log_probs", "tails", "log_ratio"):
            for a, b in zip(got[field], want[field]):
                finite = torch.isfinite(b)
                assert torch.equal(torch.isfinite(a), finite), (rank, field)
                assert close(a[finite], b[finite]) <= 1e-6, (rank, field, close(a[finite], b[finite]))
        assert any(bool(alive.any()) for alive in got["alive"])  # some bucket is live: values compared


def test_a_student_at_pp2_or_cp2_gets_the_one_rank_teachers_scores_in_its_own_rows(world):
    """Beside a student at PP=2 the first stage takes part with no samples and the last gets every
    score; at CP=2 each rank keeps its zigzag rows of every sample's scores (each sample scored by
    one rank's turn, the whole scores summed over the context-parallel group)."""
    served(world)
    first, last = world
    assert first["student_pp2"] is None
    for got, want in zip(last["student_pp2"], last["student_ref"]):
        assert len(got) == len(want) == 3
        assert all(close(a, b) <= 1e-6 for a, b in zip(got, want))
    for result in world:
        for got, want in zip(result["student_cp2"], result["student_cp2_ref"]):
            assert [tuple(a.shape) for a in got] == [tuple(b.shape) for b in want]
            assert all(close(a, b) <= 1e-6 for a, b in zip(got, want))
    assert any(a.shape != b.shape for a, b in zip(first["student_cp2"][0], first["student_ref"][0]))  # rows cut
    assert first["cut_round_trip"] and last["cut_round_trip"]


def test_a_pp2_entry_gives_each_rank_the_one_rank_teachers_topk_log_probs_and_tails(world):
    served(world)
    for rank, result in enumerate(world):
        for key in ("log_probs", "tails"):
            assert len(result[f"pp2_{key}"]) == len(SAMPLES[rank])
            for got, want in zip(result[f"pp2_{key}"], result[f"ref_{key}"]):
                assert got.shape == want.shape and close(got, want) <= 1e-6, (rank, key, close(got, want))


@pytest.mark.parametrize(("entry", "mode", "resident"), [("tp=2", "stream", ""), ("pp=2", "swap", "pp2_")])
def test_a_layout_entry_at_the_runs_residency_gives_the_resident_entrys_scores_bit_for_bit(world, entry, mode,
                                                                                            resident):
    """MEGATRON_RL_PATCHES_OPD_RESIDENCY=stream with `PATH;tp=2`, =swap with `PATH;pp=2`: each rank's
    [R, k] log-probs and [R] tails equal the resident entry's (torch.equal); each rank's shard in host
    memory, nothing on the device after the step."""
    served(world)
    for rank, result in enumerate(world):
        got = result[f"{mode}_{entry}"]
        for key in ("log_probs", "tails"):
            assert all(torch.equal(a, b) for a, b in zip(got[key], result[f"{resident}{key}"], strict=True)), rank
        assert got["report"]["mode"] == mode and got["report"]["device_weight_bytes"] == 0, rank
        assert got["report"]["host_bytes"] == got["report"]["resident_weight_bytes"] > 0, rank  # its shard


def test_a_rank_without_samples_still_takes_part(world):
    served(world)
    assert world[0]["empty_or_not"].log_probs == [] and world[0]["empty_or_not"].tails == []
    assert len(world[1]["log_probs"]) == len(SAMPLES[1])  # the other rank's samples all scored: compared below
    for got, want in zip(world[1]["empty_or_not"].log_probs, world[1]["log_probs"], strict=True):
        assert torch.equal(got, want)
    for got, want in zip(world[1]["empty_or_not"].tails, world[1]["tails"], strict=True):
        assert torch.equal(got, want)


def test_each_rank_reads_half_of_the_teachers_bytes(world):
    served(world)
    read_shares(world, "slime_opd teacher at tp=2")


def test_an_entry_the_world_cannot_hold_is_refused_on_every_rank(world):
    for result in world:
        assert "'" in result["tp4"] and ";tp=4' cannot be laid over 2 rank(s)" in result["tp4"]
        if "unsupported" in result:  # 0.13.1: refused by name before any teacher loads
            assert result["unsupported"].startswith("MEGATRON_RL_PATCHES_OPD_TEACHERS entry '")
            assert "needs megatron-core's ProcessGroupCollection" in result["unsupported"]
