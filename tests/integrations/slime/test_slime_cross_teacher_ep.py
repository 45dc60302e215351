"""slime_opd's teacher with another tokenizer at expert parallelism 2 (issue 58 item 3), on 2 gloo
ranks with Megatron's parallel state (EP=2: the two data-parallel ranks are one expert-parallel
group). The data-parallel ranks hold different samples in as many micro-batches (slime's schedule:
rank 0 two samples in one, rank 1 another alone); the student (DeepSeek's tokenizer) spells rank
0's samples in fewer tokens than the teacher (Qwen's), so the teacher's own micro-batches, planned
under the student's token budget from each rank's re-tokenized samples, differ in number (2 and 1);
an MoE layer's dispatcher makes collectives over the expert-parallel group at every forward, so a
rank running fewer forwards leaves the other waiting (a hang). Each pass here stands for a
`forward_only` over MoE layers: it gathers the ranks' micro-batch counts (one collective, never a
hang) and, when they agree, makes one collective per micro-batch, as a dispatcher does. The fix
agrees the count (`expert_agreement`: rank 1 repeats its shortest sample alone, its values dropped),
and each rank's scores equal its samples scored at one rank bit for bit; the negative control, the
agreement undone, shows the counts the dispatchers would have hung on. The slime lane runs the
teacher through slime's real `train_actor` at EP=2."""
from __future__ import annotations

import pytest

pytest.importorskip("tokenizers")

from megatron_rl_patches.testing import layouts  # noqa: E402
from tests.cross_tokenizer import conftest as tokenizers  # noqa: E402
from tests.cross_tokenizer.conftest import TEXTS  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.multirank, layouts.mark("ep2")]

qwen3, deepseek = tokenizers.qwen3, tokenizers.deepseek  # the real-tokenizer fixtures
RANK_TEXTS = (("english", "chinese"), ("mixed",))
FIELDS = ("log_probs", "tails", "ids", "ids_mask", "alive", "log_ratio")


def _rank_rollout(student_dir: str, rank: int) -> dict:
    """slime's rollout fields of this rank's samples in one micro-batch: rank 0 two texts its
    teacher spells in more tokens than the student (24 + 17 < 26 + 18), rank 1 one it spells alike."""
    import torch

    from megatron_rl_patches.cross_tokenizer import load_tokenizer

    tok = load_tokenizer(f"{student_dir}/tokenizer.json")
    tokens, responses = [], []
    for text in RANK_TEXTS[rank]:
        prompt, response = (tok.encode(t, add_special_tokens=False).ids for t in ("Q: ", TEXTS[text]))
        tokens.append(torch.tensor(prompt + response))
        responses.append(len(response))
    return {"tokens": tokens, "response_lengths": responses, "total_lengths": [len(t) for t in tokens],
            "loss_masks": [torch.ones(r, dtype=torch.int) for r in responses],
            "micro_batch_indices": [list(range(len(tokens)))], "num_microbatches": [1]}


def _actor(student_dir: str, teacher_dir: str):
    from megatron_rl_patches.cross_tokenizer import load_tokenizer
    from tests.integrations.slime.test_slime_opd_teachers import Actor, TinyHead, cross_teacher

    student = TinyHead.random(load_tokenizer(f"{student_dir}/tokenizer.json").get_vocab_size(), 0)
    other = TinyHead.random(load_tokenizer(f"{teacher_dir}/tokenizer.json").get_vocab_size(), 2)
    actor = Actor(student, {})
    actor.args.hf_checkpoint = student_dir
    return actor, cross_teacher(actor.args, teacher_dir, [other])


def scores_of(student_dir: str, teacher_dir: str, data: dict, topk_pass) -> dict:
    """The cross teacher's scores of `data` through `topk_pass` (the student's pass first)."""
    from megatron_rl_patches.integrations.megatron.opd.opd_settings import opd_settings
    from megatron_rl_patches.integrations.megatron.opd.opd_teachers import ScoringStep
    from megatron_rl_patches.integrations.slime import opd

    actor, teacher = _actor(student_dir, teacher_dir)
    settings = opd_settings({"MEGATRON_RL_PATCHES_OPD_TEACHERS": f"{teacher_dir};tokenizer=own",
                             "MEGATRON_RL_PATCHES_OPD_K": "4"})
    student = topk_pass(actor.args, actor.model, data, opd.TopkRequest(k=settings.k))
    data[opd.IDS] = student["topk_ids"]
    scores = teacher.score(ScoringStep(actor, data, settings, True, student, topk_pass))
    return {field: getattr(scores, field) for field in FIELDS}


def _dispatching_pass(counts: list):
    """opd's pass contract over a TinyHead, with an MoE dispatcher's collectives over the
    expert-parallel group: the ranks' micro-batch counts gathered (noted in `counts`), then one
    all-reduce per micro-batch when they agree (skipped when not: the test's hang, named)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from tests.integrations.slime.test_slime_opd_teachers import topk_pass

    def dispatching(args, model, rollout_data, request):
        group = parallel_state.get_expert_model_parallel_group()
        mine = torch.tensor([len(rollout_data["micro_batch_indices"])])
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, mine, group=group)
        counts.append([int(c) for c in every])
        if len(set(counts[-1])) == 1:
            for _ in rollout_data["micro_batch_indices"]:
                dist.all_reduce(torch.ones(1), group=group)
        return topk_pass(args, model, rollout_data, request)

    return dispatching


def _scored_at_ep2(rank: int, world_size: int, student_dir: str, teacher_dir: str, standins: str) -> dict:
    import sys

    from megatron.core import parallel_state

    from megatron_rl_patches.integrations.megatron.opd import expert_agreement
    from megatron_rl_patches.testing.megatron_cpu import megatron_world

    sys.path.insert(0, standins)  # the stand-in slime (its cp_utils at one context-parallel rank)
    out: dict = {}
    with megatron_world("cpu", expert_parallel=2):
        out["ep"] = parallel_state.get_expert_model_parallel_world_size()
        for agreed in (True, False):
            counts: list = []
            real = expert_agreement.agreed_micro_batches
            if not agreed:  # the negative control: each rank plans from its own samples alone
                expert_agreement.agreed_micro_batches = lambda count: count
            try:
                scores = scores_of(student_dir, teacher_dir, _rank_rollout(student_dir, rank),
                                   _dispatching_pass(counts))
            finally:
                expert_agreement.agreed_micro_batches = real
            out[agreed] = {"counts": counts, "scores": scores}
    return out


@pytest.fixture(scope="module")
def dirs(qwen3, deepseek, tmp_path_factory):
    from megatron_rl_patches.cross_tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("ep2")
    for name, tok in (("student", deepseek), ("teacher", qwen3)):
        (root / name).mkdir()
        load_tokenizer(tok).save(str(root / name / "tokenizer.json"))
    return str(root / "student"), str(root / "teacher")


@pytest.fixture(scope="module")
def ranks(dirs) -> list:
    from megatron_rl_patches.testing.multirank import run_multirank
    from tests.conftest import STANDINS

    return run_multirank(_scored_at_ep2, 2, *dirs, str(STANDINS), timeout=120)


def test_every_expert_parallel_rank_runs_as_many_teacher_forwards(ranks):
    assert [rank["ep"] for rank in ranks] == [2, 2]
    for rank in ranks:  # the student's pass (slime's schedule), then the teacher's two, agreed at 2
        assert rank[True]["counts"] == [[1, 1], [2, 2], [2, 2]]
    # negative control: planned from each rank's own samples, rank 1's teacher runs 1 forward, rank 0's 2
    for rank in ranks:
        assert rank[False]["counts"] == [[1, 1], [2, 1], [2, 1]]


def test_each_ranks_scores_equal_its_samples_scored_alone(ranks, dirs, megatron_cpu, slime_standin):
    import torch

    from tests.integrations.slime.test_slime_opd_teachers import topk_pass

    for index, rank in enumerate(ranks):
        alone = scores_of(*dirs, _rank_rollout(dirs[0], index), topk_pass)
        for agreed in (True, False):
            got = rank[agreed]["scores"]
            for field in FIELDS:
                assert len(got[field]) == len(alone[field]) == 2 - index, field
                assert all(torch.equal(a, b) for a, b in zip(got[field], alone[field])), (index, field)
        assert any(bool(a.any()) for a in alone["alive"])
