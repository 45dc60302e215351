"""slime_opd's served teacher asked at the rollout (issue 88 item 2, MEGATRON_RL_PATCHES_OPD_SCORE_AT):
slime 624b824a's real rollout functions in a fresh interpreter (slime_rollout_scores.py: its
`generate_and_rm_group`, sample hooks, rollout metrics and per-rank split, SGLang's `/generate`
answered with token ids sampled by a real vLLM CPU server of a tiny Qwen3), the same server as the
served teacher (top-k route, MEGATRON_RL_PATCHES_OPD_IDS_FROM=teacher, a snapshot teacher beside
it), then slime's real `MegatronTrainRayActor.train_actor` at one rank and TP=2 on that rollout:
with SCORE_AT=rollout each sample's rows come with it (slime's rollout metrics hold teacher/...
keys), the train step asks nothing (its metrics: every sample scored before, no byte received) and
its losses equal those of the same rollout scored by the train step within 1e-6 (SCORE_AT=train:
nothing carried, the step asks). Without MRP_VLLM_PYTHON the test skips naming it."""
from __future__ import annotations

import pytest
import torch

from tests.integrations.slime.lane.served_qwen3_kit import VLLM_PYTHON, served_checkpoint, slime_rollout

pytestmark = pytest.mark.slime

PROMPTS, RESPONSE = (5, 7, 4, 6), 5


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from megatron_rl_patches.testing.vllm_server import vllm_server

    root = tmp_path_factory.mktemp("served")
    directory = served_checkpoint(root)
    with vllm_server(VLLM_PYTHON, directory, root / "vllm.log", max_model_len=256, max_logprobs=20) as server:
        yield server.url, str(directory)


def entries(url: str) -> str:
    return f"{url};engine=vllm,teacher-a"


def rollout_at(tmp_path, url: str, directory: str, score_at: str) -> dict:
    """slime's rollout in its own interpreter (as its rollout manager runs): the rank's data and figures."""
    config = {"engine": url, "model": directory, "prompts": list(PROMPTS), "response": RESPONSE, "seed": 0}
    return slime_rollout(tmp_path, score_at, config, entries(url), score_at)


def trained(rank_data: dict, url: str, directory: str, tensor: int) -> list[dict]:
    """slime's train_actor on the rollout's samples (the CONTEXTS the split carried, rows or none)."""
    import slime_ranks

    from megatron_rl_patches.integrations.megatron.opd.topk_request import CONTEXTS
    from megatron_rl_patches.testing.multirank import run_multirank

    gen = torch.Generator().manual_seed(1)
    one = {"tokens": list(rank_data["tokens"]), "total_lengths": [len(t) for t in rank_data["tokens"]],
           "response_lengths": [int(r) for r in rank_data["response_lengths"]],
           "loss_masks": [torch.as_tensor(m, dtype=torch.int) for m in rank_data["loss_masks"]],
           "advantages": [torch.randn(int(r), generator=gen) for r in rank_data["response_lengths"]],
           "micro_batch_indices": [[0, 1], [2, 3]]}
    served = {"entries": entries(url), "student": directory, "rollouts": [one]}
    if CONTEXTS in rank_data:
        served["contexts"] = rank_data[CONTEXTS]
    return run_multirank(slime_ranks.opd_train_actor, tensor, 1, 1, tensor, None, None, (), 1, None, 1, None, None,
                         served, timeout=500)


@pytest.fixture(scope="module")
def rollouts(served, tmp_path_factory):
    url, directory = served
    tmp = tmp_path_factory.mktemp("rollouts")
    return {where: rollout_at(tmp, url, directory, where) for where in ("rollout", "train")}


def test_slimes_rollout_carries_each_samples_rows_and_logs_the_teachers_figures(slime_cpu, rollouts):
    from megatron_rl_patches.integrations.megatron.opd.carried_rows import ROWS
    from megatron_rl_patches.integrations.megatron.opd.topk_request import CONTEXTS

    carried, asked = rollouts["rollout"], rollouts["train"]
    assert [int(r) for r in carried["rank"]["response_lengths"]] == [RESPONSE] * 4
    rows = carried["rank"][CONTEXTS]
    assert len(rows) == 4 and all(set(one) == {ROWS} and len(one[ROWS]) == 1 for one in rows)
    for one, response in zip(rows, carried["rank"]["response_lengths"]):
        (got,) = one[ROWS].values()
        assert got["ids"].shape == (int(response), 4) and got["ids"].dtype == torch.int32
        assert got["digest"][0] == len(got["token"]) + got["digest"][1]  # length = start + response rows
    logged = carried["logged"]
    assert logged["teacher/samples"] == 4 and logged["teacher/bytes"] > 0 and logged["teacher/taken_out"] == 0
    assert CONTEXTS not in asked["rank"] and not any(k.startswith("teacher/") for k in asked["logged"])


@pytest.mark.parametrize("tensor", [1, 2])
def test_train_actor_reads_the_carried_rows_unasked_with_the_train_steps_losses(slime_cpu, rollouts, served, tensor):
    from megatron_rl_patches.integrations.megatron.opd.topk_request import CONTEXTS

    url, directory = served
    carried = rollouts["rollout"]["rank"]
    asked_data = {key: value for key, value in carried.items() if key != CONTEXTS}  # the same samples, no rows
    read, asked = trained(carried, url, directory, tensor), trained(asked_data, url, directory, tensor)
    (read_losses,), (asked_losses,) = read[-1]["losses"], asked[-1]["losses"]
    figures_read, figures_asked = read[0]["teacher_figures"], asked[0]["teacher_figures"]
    difference = max(abs(float(read_losses[name]) - float(asked_losses[name])) for name in read_losses)
    print(f"slime_opd train_actor TP={tensor}, served teacher at the rollout vs at the train step: max |Δloss| "
          f"{difference:.2e}; collect() waited {figures_read['collect_wait_s']:.3f} s vs "
          f"{figures_asked['collect_wait_s']:.3f} s")
    assert set(read_losses) == set(asked_losses) and difference <= 1e-6, (read_losses, asked_losses)
    assert all(torch.equal(a, b) for a, b in zip(read[-1]["ids"], asked[-1]["ids"]))  # the teacher's own top-k
    assert figures_read["scored_before"] == 4 and figures_read["bytes"] == 0  # nothing asked by the step
    assert figures_asked["scored_before"] == 0 and figures_asked["bytes"] > 0
