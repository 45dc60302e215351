"""What prompt affinity buys on vLLM 0.32 (issue 86 item 2), read from a real server's `/metrics`
(the lane's `spare`, started with `--enable-prefix-caching`): a plain completion of a prompt asked
twice reads the prefix cache (the control: the counters move), while a teacher's prompt log-probs
of G samples sharing that prompt, all sent to this one replica, read nothing from it — vLLM turns
cache reads off for prompt log-probs (`skip_reading_prefix_cache`). Cheap: one replica, one step."""
from __future__ import annotations

import torch

from megatron_rl_patches.teachers import ClientSettings, PromptAffinity, ReplicaSettings, ServedTeacher, TeacherBatch
from tests.teachers.lane.served_kit import API_KEY, VOCAB

K, PROMPT, RESPONSE, GROUP = 4, 200, 16, 4
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def counters(url: str) -> tuple[float, float]:
    """The server's prefix-cache (queries, hits) so far, in tokens."""
    import httpx

    text = httpx.get(url + "/metrics", headers=AUTH, timeout=30).text
    totals = {"vllm:prefix_cache_queries": 0.0, "vllm:prefix_cache_hits": 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        for key in totals:
            if name in (key, key + "_total"):
                totals[key] += float(line.rsplit(" ", 1)[1])
    return totals["vllm:prefix_cache_queries"], totals["vllm:prefix_cache_hits"]


def test_prompt_log_probs_read_nothing_from_the_prefix_cache(served, spare):
    import httpx

    gen = torch.Generator().manual_seed(31)
    prompt = torch.randint(0, VOCAB, (PROMPT,), generator=gen)
    name = httpx.get(spare.url + "/v1/models", headers=AUTH).json()["data"][0]["id"]
    before = counters(spare.url)
    for _ in range(2):  # the control: a plain completion of the prompt, asked twice
        reply = httpx.post(spare.url + "/v1/completions", headers=AUTH, timeout=120,
                           json={"model": name, "prompt": prompt.tolist(), "max_tokens": 1})
        assert reply.status_code == 200, reply.text
    control = counters(spare.url)
    assert control[1] - before[1] > 0, (before, control)  # the cache is on and read
    batch = TeacherBatch([torch.cat([prompt, torch.randint(0, VOCAB, (RESPONSE,), generator=gen)])
                          for _ in range(GROUP)], [PROMPT] * GROUP)
    with ServedTeacher(spare.url, top_k=K, client=ClientSettings(deadline_s=120),
                       replicas=ReplicaSettings(spread=PromptAffinity())) as teacher:
        teacher.score(batch)
    after = counters(spare.url)
    print(f"prefix cache (queries, hits) in tokens: control {control[0] - before[0]:g}, {control[1] - before[1]:g}; "
          f"the teacher's {GROUP} samples of one {PROMPT}-token prompt: {after[0] - control[0]:g}, "
          f"{after[1] - control[1]:g}")
    assert after[1] - control[1] == 0  # not one token of the group's shared prompt read from the cache


