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

from megatron_rl_patches.integrations.slime.step_plan import IDS, TEACHER_LOGPROBS
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
    from megatron_rl_patches.integrations.slime import opd as slime_opd
    from megatron_rl_patches.integrations.slime.layout_teacher import LayoutTeacher
    from megatron_rl_patches.integrations.slime.opd_settings import RESIDENCY, TEACHERS, opd_settings
    from megatron_rl_patches.integrations.slime.opd_settings import K as K_SETTING
    from megatron_rl_patches.integrations.slime.opd_teachers import ScoringStep
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
        # MEGATRON_RL_PATCHES_OPD_RESIDENCY at a layout: `;tp=2` streamed, `;pp=2` swapped
        for entry, mode in (("tp=2", "stream"), ("pp=2", "swap")):
            moved = opd_settings({TEACHERS: f"{root};{entry}", K_SETTING: str(K), RESIDENCY: mode})
            (teacher,) = slime_opd.load_teachers(actor, moved)
            scores = teacher.score(ScoringStep(actor, _rollout(rank), moved, True, {}, topk_pass=None))
            results[f"{mode}_{entry}"] = {"log_probs": scores.log_probs, "tails": scores.tails,
                                          "report": residency_report(list(teacher)).as_dict()}
        dist.barrier()  # every rank got here: nothing above left a rank waiting
    return results


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
    for got, want in zip(world[1]["empty_or_not"].log_probs, world[1]["log_probs"]):
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
