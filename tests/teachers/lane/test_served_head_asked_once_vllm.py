"""slime's served teacher with a head (`http://host:port;engine=vllm;head=DIR`) on the teacher step
asks the session's real vLLM pooling server (conftest `pooled`) once per sample per data-parallel
rank: at TP=2 and at CP=2 only the first rank of the tensor and context-parallel group sends the
samples (and the load's check), the server's own access log counting its `/pooling` requests, and
every rank keeps the rows of one whole-head score of the same samples (each CP rank its zigzag
part). Before the step, every rank of the group asked: twice the requests."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from tests.teachers.lane.served_kit import VOCAB

K = 8
LENGTHS, PROMPTS = (14, 40, 9, 60), (3, 17, 1, 30)
LAYOUTS = (("tp2", {"tensor_parallel": 2}), ("cp2", {"context_parallel": 2}))


def rollout() -> dict:
    gen = torch.Generator().manual_seed(11)
    tokens = [torch.randint(0, VOCAB, (n,), generator=gen) for n in LENGTHS]
    return {"tokens": tokens, "response_lengths": [n - p for n, p in zip(LENGTHS, PROMPTS)],
            "total_lengths": list(LENGTHS)}


def settings(url: str, directory: str):
    from megatron_rl_patches.integrations.megatron.opd.opd_settings import opd_settings

    return opd_settings({"MEGATRON_RL_PATCHES_OPD_TEACHERS": f"{url};engine=vllm;head={directory}",
                         "MEGATRON_RL_PATCHES_OPD_IDS_FROM": "teacher", "MEGATRON_RL_PATCHES_OPD_K": str(K)})


def pooling_requests(log) -> int:
    """The `/pooling` requests the server's access log holds."""
    return sum('"POST /pooling ' in line for line in log.read_text(errors="replace").splitlines())


def head_world(rank: int, world: int, url: str, directory: str) -> dict:
    """Per layout: this rank's step with slime's head teacher (load, begin, score), the rows kept
    (whole responses: a CP rank's zigzag part joined with the other's)."""
    from megatron_rl_patches.integrations.megatron.opd.opd_teachers import ScoringStep
    from megatron_rl_patches.integrations.megatron.opd.served_opd import ServedOpdTeacher
    from megatron_rl_patches.integrations.megatron.opd.served_teacher import served_head
    from megatron_rl_patches.integrations.megatron.opd.stage_host import stage_host
    from megatron_rl_patches.integrations.megatron.opd.topk_request import IDS
    from megatron_rl_patches.integrations.megatron.opd.zigzag import whole_from_zigzag
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    chosen = settings(url, directory)
    args = SimpleNamespace(hf_checkpoint=directory, rollout_temperature=1.0)
    results = {}
    for name, sizes in LAYOUTS:
        with megatron_on_cpu(**sizes):
            host = stage_host(VOCAB)
            teacher = ServedOpdTeacher(served_head(args, chosen, chosen.teachers[0], VOCAB, host, "entry"), host)
            data = rollout()
            teacher.begin(None, data)
            scores = teacher.score(ScoringStep(None, data, chosen, True, {}, None))  # type: ignore[arg-type]
            teacher.teacher.close()
            assert scores is not None
            kept = {"ids": data[IDS], "values": scores.log_probs, "tails": scores.tails}
            results[name] = {key: whole_from_zigzag(list(values), data["total_lengths"], data["response_lengths"])
                             for key, values in kept.items()}
    return results


def test_a_head_teacher_is_asked_once_per_group_and_every_rank_keeps_the_rows(pooled, checkpoint):
    from megatron_rl_patches.integrations.megatron.opd.stage_host import batch_of
    from megatron_rl_patches.teachers import ServedTeacher
    from megatron_rl_patches.testing.multirank import run_multirank

    log = checkpoint[0] / "vllm-pooling.log"
    before = pooling_requests(log)
    ranks = run_multirank(head_world, 2, pooled.url, str(pooled.directory), timeout=400)
    asked = pooling_requests(log) - before
    # per layout: the load's check (one tiny request) and each sample once, from the asking rank only
    assert asked == len(LAYOUTS) * (1 + len(LENGTHS)), asked
    with ServedTeacher(pooled.url, head=str(pooled.directory), top_k=K) as teacher:
        whole = teacher.score(batch_of(rollout()))
    for name, _ in LAYOUTS:
        for rank in ranks:
            kept = rank[name]
            for i in range(len(LENGTHS)):
                assert torch.equal(kept["ids"][i], whole.topk_ids[i]), (name, i)
                torch.testing.assert_close(kept["values"][i], whole.topk_log_probs[i].float(), rtol=0, atol=2e-6)
                torch.testing.assert_close(kept["tails"][i], whole.tail_log_probs[i].float(), rtol=0, atol=2e-6)
