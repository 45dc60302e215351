"""slime 624b824a's real `MegatronTrainRayActor.train_actor` with its served teacher
(`MEGATRON_RL_PATCHES_OPD_TEACHERS=http://...;engine=vllm`, its own top-k as the buckets, a snapshot
teacher beside it) pointed at `megatron-rl-patches serve-teacher` and at a stock vLLM server of the
same tiny Qwen3 (both on vLLM's CPU build, MRP_VLLM_PYTHON, started once for the module), on GRPO
groups: 2 prompts of 4 samples each, one prompt a multiple of serve-teacher's KV block and one not
(issue 98, Done-when item 3). Asked by the train step, and asked by slime's real rollout functions
as each sample's generation ends (MEGATRON_RL_PATCHES_OPD_SCORE_AT=rollout,
`slime_rollout_scores.py`: `generate_and_rm_group` with the group's 4 samples, the rows carried to
train_actor in train_metadata): the losses and the first step's gradients equal the stock server's
within 1e-6, and the teacher tokens each server's engine computed (its `/metrics`, prompt tokens
computed locally) are a group's prompt once on serve-teacher, P + G·R (with the prompt's partly
filled last block again for each later member), against G·(P + R) on the stock server. Without
MRP_VLLM_PYTHON the tests skip naming it (the slime lane is outside `make test`)."""
from __future__ import annotations

import contextlib
import urllib.request

import pytest
import torch

from megatron_rl_patches.teachers.served.engines.vllm import PROBE_IDS  # what the client scores at connect
from megatron_rl_patches.testing.vllm_server import launch, stop, wait_ready
from tests.integrations.slime.lane.served_qwen3_kit import VLLM_PYTHON, VOCAB, served_checkpoint, slime_rollout

pytestmark = pytest.mark.slime

BLOCK = 32  # serve-teacher's KV block (vLLM's CPU backend: multiples of 32)
GROUP = 4  # samples per prompt
PROMPTS = (BLOCK, 45)  # a group's prompt length: a multiple of the block, and not (the student's SEQ is 64)
RESPONSES = (6, 3, 8, 5)  # the train step's responses of each group's members
RESPONSE = 8  # the rollout's (slime's --rollout-max-response-len; no EOS)
BOUND = 1e-6


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """{"stock": URL, "ours": URL} of a stock vLLM server and serve-teacher of one checkpoint, and its directory."""
    root = tmp_path_factory.mktemp("served")
    directory = served_checkpoint(root)
    with contextlib.ExitStack() as stack:  # both load side by side; each stopped on exit
        started = {"stock": launch(VLLM_PYTHON, directory, root / "vllm.log", max_model_len=256, max_logprobs=20)}
        stack.callback(stop, started["stock"].process)
        started["ours"] = launch(VLLM_PYTHON, directory, root / "serve-teacher.log", max_model_len=256,
                                 max_logprobs=20, serve_teacher=True, extra=("--block-size", str(BLOCK)))
        stack.callback(stop, started["ours"].process)
        for server in started.values():
            wait_ready(server, 600.0)
        yield {name: server.url for name, server in started.items()}, str(directory)


def computed_tokens(url: str) -> float:
    """The prompt tokens the server's engine computed so far (vLLM's own counter, by source)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prompt_tokens_by_source_total{") and 'source="local_compute"' in line)


def whole(lengths: list[int]) -> int:
    """A stock server's tokens for samples of these lengths: every sample whole, and the client's
    probe at connect."""
    return sum(lengths) + len(PROBE_IDS)


def shared_once(prompts: list[int], responses: list[int]) -> int:
    """serve-teacher's tokens for groups of GROUP samples: each prompt once, every response, the
    prompt's partly filled last block again for each later member (the engine caches whole blocks),
    and the client's probe at connect."""
    return sum(responses) + sum(p + (GROUP - 1) * (p % BLOCK) for p in prompts) + len(PROBE_IDS)


def entries(url: str) -> str:
    return f"{url};engine=vllm,teacher-a"


def grouped_rollout(seed: int) -> dict:
    """A rollout of GROUP samples per prompt (PROMPTS), as slime's actor gets it: each member's
    response its own (distinct first ids), 2 samples a micro-batch."""
    gen = torch.Generator().manual_seed(seed)
    tokens = []
    for length in PROMPTS:
        prompt = torch.randint(0, VOCAB, (length,), generator=gen)
        firsts = torch.randperm(VOCAB, generator=gen)[:GROUP]
        for first, response in zip(firsts, RESPONSES, strict=True):
            tokens.append(torch.cat([prompt, first[None], torch.randint(0, VOCAB, (response - 1,), generator=gen)]))
    responses = list(RESPONSES) * len(PROMPTS)
    return {"tokens": tokens, "total_lengths": [len(t) for t in tokens], "response_lengths": responses,
            "loss_masks": [torch.ones(r, dtype=torch.int) for r in responses],
            "advantages": [torch.randn(r, generator=gen) for r in responses],
            "micro_batch_indices": [[i, i + 1] for i in range(0, len(tokens), 2)]}


def trained(rollout: dict, url: str, directory: str, contexts: list | None = None) -> list[dict]:
    """slime's train_actor (1 rank) on `rollout` with the served teacher at `url` (`contexts`: the
    rows the rollout carried, as slime's split hands them over)."""
    import slime_ranks

    from megatron_rl_patches.testing.multirank import run_multirank

    served = {"entries": entries(url), "student": directory, "rollouts": [rollout]}
    if contexts is not None:
        served["contexts"] = contexts
    return run_multirank(slime_ranks.opd_train_actor, 1, 1, 1, 1, None, None, (), 1, None, 1, None, None, served,
                         timeout=500)


def assert_same_training(got_ranks: list[dict], want_ranks: list[dict], what: str) -> None:
    """The same ids, losses and first gradients within BOUND (one rank each)."""
    (got,), (want,) = got_ranks, want_ranks
    assert len(got["losses"]) == len(want["losses"]) > 0
    loss_error = max(abs(float(a[name]) - float(b[name])) for a, b in zip(got["losses"], want["losses"]) for name in a)
    grad_error = max((got["grads"][name].double() - want["grads"][name].double()).abs().max().item()
                     for name in want["grads"])
    print(f"slime_opd train_actor, {what}, serve-teacher vs the stock server: max |Δloss| {loss_error:.2e}, "
          f"max |Δgrad| {grad_error:.2e}")
    assert all(torch.equal(a, b) for a, b in zip(got["ids"], want["ids"], strict=True))  # the teacher's own top-k
    assert [set(a) for a in got["losses"]] == [set(b) for b in want["losses"]]
    assert loss_error <= BOUND, (got["losses"], want["losses"])
    assert grad_error <= BOUND


def test_train_step_against_serve_teacher_equals_the_stock_server_and_computes_each_prompt_once(slime_cpu, servers):
    urls, directory = servers
    rollout = grouped_rollout(0)
    runs, spent = {}, {}
    for name, url in urls.items():
        before = computed_tokens(url)
        runs[name] = trained(rollout, url, directory)
        spent[name] = computed_tokens(url) - before
    assert_same_training(runs["ours"], runs["stock"], "asked by the train step")
    (figures,) = [rank["teacher_figures"] for rank in runs["ours"]]
    assert figures["samples"] == len(rollout["tokens"]) and figures["taken_out"] == 0
    prompts = [p for p in PROMPTS for _ in range(GROUP)]
    print(f"train step, {len(PROMPTS)} groups of {GROUP} (P = {PROMPTS}): teacher tokens computed: serve-teacher "
          f"{spent['ours']:g}, the stock server {spent['stock']:g}")
    assert sum(rollout["total_lengths"]) == sum(prompts) + sum(rollout["response_lengths"])
    assert spent["stock"] == whole(rollout["total_lengths"])
    assert spent["ours"] == shared_once(list(PROMPTS), rollout["response_lengths"]) < spent["stock"]


def step_rollout(rank_data: dict) -> dict:
    """The rollout's rank data as train_actor takes it (advantages drawn once, 2 samples a micro-batch)."""
    gen = torch.Generator().manual_seed(1)
    return {"tokens": list(rank_data["tokens"]), "total_lengths": [len(t) for t in rank_data["tokens"]],
            "response_lengths": [int(r) for r in rank_data["response_lengths"]],
            "loss_masks": [torch.as_tensor(m, dtype=torch.int) for m in rank_data["loss_masks"]],
            "advantages": [torch.randn(int(r), generator=gen) for r in rank_data["response_lengths"]],
            "micro_batch_indices": [[i, i + 1] for i in range(0, len(rank_data["tokens"]), 2)]}


def test_rows_scored_at_slimes_rollout_by_serve_teacher_train_as_the_stock_servers(slime_cpu, servers,
                                                                                  tmp_path):
    from megatron_rl_patches.integrations.megatron.opd.topk_request import CONTEXTS

    urls, directory = servers
    rollouts, spent = {}, {}
    for name, url in urls.items():  # the same samples (seeded by slime's session ids), the teacher asked differs
        before = {other: computed_tokens(u) for other, u in urls.items()}
        config = {"engine": urls["stock"], "model": directory, "prompts": list(PROMPTS), "group": GROUP,
                  "response": RESPONSE, "seed": 7}  # generated by the stock server in both runs
        rollouts[name] = slime_rollout(tmp_path, name, config, entries(url), "rollout")
        spent[name] = {other: computed_tokens(u) - before[other] for other, u in urls.items()}
    ours, stock = rollouts["ours"]["rank"], rollouts["stock"]["rank"]
    assert len(ours["tokens"]) == len(PROMPTS) * GROUP
    assert all(torch.equal(torch.as_tensor(a), torch.as_tensor(b)) for a, b in zip(ours["tokens"], stock["tokens"]))
    for number, length in enumerate(PROMPTS):  # each group's members share their prompt, their responses differ
        members = [list(t) for t in ours["tokens"][number * GROUP: (number + 1) * GROUP]]
        assert all(m[:length] == members[0][:length] for m in members) and len({tuple(m) for m in members}) == GROUP
    assert rollouts["ours"]["logged"]["teacher/samples"] == len(PROMPTS) * GROUP
    responses = [int(r) for r in ours["response_lengths"]]
    # the stock server generates in both runs: its own teacher tokens are what the run asking it spent more
    stock_teacher = spent["stock"]["stock"] - spent["ours"]["stock"]
    print(f"rollout, {len(PROMPTS)} groups of {GROUP} (P = {PROMPTS}, R = {RESPONSE}): teacher tokens computed: "
          f"serve-teacher {spent['ours']['ours']:g}, the stock server {stock_teacher:g}")
    assert spent["stock"]["ours"] == 0
    assert stock_teacher == whole([len(t) for t in ours["tokens"]])
    assert spent["ours"]["ours"] == shared_once(list(PROMPTS), responses) < stock_teacher
    data = step_rollout(ours)
    read = {name: trained(data, url, directory, rollouts[name]["rank"][CONTEXTS]) for name, url in urls.items()}
    assert_same_training(read["ours"], read["stock"], "rows scored at the rollout")
    for name in urls:  # the step asked nothing: every sample's rows came with it
        (figures,) = [rank["teacher_figures"] for rank in read[name]]
        assert figures["scored_before"] == len(data["tokens"]) and figures["bytes"] == 0
