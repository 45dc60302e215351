"""`serve-teacher`'s request shaping without vLLM (the served lane runs the server itself): the bodies
it takes and refuses by field, a group's turn and the rows kept for it, the rows formed from states
against a float64 reference, the version refusal; and the client's side: a server whose card says
it shares a prefix is sent `response_start` (vLLM's own server never), a pooling reply that starts
at `first_row` is read, and serve-teacher replicas are spread by prompt affinity unless told."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch

from megatron_rl_patches.apps.cli import main
from megatron_rl_patches.apps.serve_teacher import bodies
from megatron_rl_patches.apps.serve_teacher.prefixes import SharedPrefixes
from megatron_rl_patches.apps.serve_teacher.rows import prompt_log_prob_entries
from megatron_rl_patches.apps.serve_teacher.versions import check_vllm_version
from megatron_rl_patches.teachers import ClientSettings, FewestInFlight, PromptAffinity, ReplicaSettings, ServedTeacher
from megatron_rl_patches.teachers.served.engines.protocol import ServedModel
from megatron_rl_patches.teachers.served.engines.vllm import VllmEngine, shares_prefix
from megatron_rl_patches.teachers.served.engines.vllm_pooling import VllmPoolingEngine
from megatron_rl_patches.teachers.served.http import TeacherClient
from megatron_rl_patches.teachers.served.scheduler import Scheduler

URL = "http://127.0.0.1:9"
OURS = {"server": "serve-teacher", "shares_prefix": True, "request_field": "response_start"}


def test_a_completion_body_is_read_and_refused_by_field():
    asked = bodies.completion({"prompt": [1, 2, 3], "prompt_logprobs": 4, "response_start": 2}, 10, 8, 20)
    assert (asked.ids, asked.start, asked.top_k) == ([1, 2, 3], 2, 4)
    assert bodies.completion({"prompt": [1, 2], "prompt_logprobs": 0}, 10, 8, 20).start is None
    cases = [({"prompt": "text", "prompt_logprobs": 1}, "list of token ids"),
             ({"prompt": [1, 10], "prompt_logprobs": 1}, "outside the model's vocabulary of 10"),
             ({"prompt": list(range(9)), "prompt_logprobs": 1}, "maximum context length is 8"),
             ({"prompt": [1, 2], "prompt_logprobs": 25}, "Requested prompt logprobs of 25, which is greater than "
                                                         "max allowed: 10"),  # the vocabulary, under the limit of 20
             ({"prompt": [1, 2], "prompt_logprobs": None}, "prompt_logprobs must be an int"),
             ({"prompt": [1, 2], "prompt_logprobs": 1, "response_start": 2}, "response_start must be an int from 1"),
             ({"prompt": [1, 2], "prompt_logprobs": 1, "response_start": True}, "response_start must be"),
             ({"prompt": [1, 2], "prompt_logprobs": 1, "stream": True}, "stream")]
    for body, words in cases:
        with pytest.raises(bodies.BadRequest, match=words.replace("(", r"\(")):
            bodies.completion(body, 10, 8, 20)


def test_a_pooling_body_is_read_and_refused_by_field():
    asked = bodies.pooling({"input": [1, 2, 3], "task": "token_embed", "encoding_format": "bytes",
                            "embed_dtype": "bfloat16", "endianness": "little", "response_start": 1}, 10, 8)
    assert (asked.ids, asked.start, asked.encoding, asked.embed_dtype) == ([1, 2, 3], 1, "bytes", "bfloat16")
    for body, words in [({"input": [1], "task": "embed"}, "task 'token_embed'"),
                        ({"input": [1], "use_activation": True}, "use_activation must be false"),
                        ({"input": [1], "encoding_format": "base64"}, "encoding_format must be one of"),
                        ({"input": [1], "embed_dtype": "fp8_e4m3"}, "embed_dtype must be one of"),
                        ({"input": [1], "endianness": "big"}, "little-endian")]:
        with pytest.raises(bodies.BadRequest, match=words):
            bodies.pooling(body, 10, 8)


def test_rows_from_states_match_a_float64_reference():
    gen = torch.Generator().manual_seed(0)
    states, weight = torch.randn(5, 16, generator=gen), torch.randn(50, 16, generator=gen)
    next_ids = [3, 7, 49, 0, 3]
    entries = prompt_log_prob_entries(states, weight, next_ids, 4)
    reference = torch.log_softmax(states.double() @ weight.double().T, dim=-1)
    for row, entry in enumerate(entries):
        top = torch.topk(reference[row], 4)
        actual = next_ids[row]
        assert set(entry) == {str(i) for i in top.indices.tolist()} | {str(actual)}
        for rank, (token, value) in enumerate(zip(top.indices.tolist(), top.values.tolist(), strict=True), 1):
            assert abs(entry[str(token)]["logprob"] - value) < 1e-5 and entry[str(token)]["rank"] == rank
        assert abs(entry[str(actual)]["logprob"] - float(reference[row, actual])) < 1e-5
        assert entry[str(actual)]["rank"] == int((reference[row] >= reference[row, actual]).sum())
    assert prompt_log_prob_entries(states[:0], weight, [], 4) == []


def test_a_group_waits_for_its_first_and_reads_the_rows_it_kept():
    prefixes = SharedPrefixes()
    order: list[str] = []
    states = torch.arange(12.0).reshape(6, 2)  # positions 3..8 of the first member (start 4)

    async def member(name: str, ids: list[int], delay: float) -> None:
        await asyncio.sleep(delay)
        async with prefixes.turn(ids, 4):
            order.append(f"{name} in")
            await asyncio.sleep(0.05 if name == "first" else 0)
            if name == "first":
                prefixes.keep(ids, 4, states)
            order.append(f"{name} out")

    async def group() -> None:
        first, second = [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9]
        await asyncio.gather(member("first", first, 0), member("second", second, 0.01))

    asyncio.run(group())
    assert order == ["first in", "first out", "second in", "second out"]  # the second waited for the first
    ids = [1, 2, 3, 4, 5, 6, 0]
    assert prefixes.rows(ids, 4, 3).numel() == 0  # nothing cached past start - 1: no kept row needed
    assert torch.equal(prefixes.rows(ids, 4, 4), states[:1])  # the row predicting the first response id
    assert torch.equal(prefixes.rows(ids, 4, 6), states[:3])  # a response agreeing with the first's
    assert prefixes.rows(ids, 4, 7) is None  # position 6 differs from the kept member's: never read
    assert prefixes.rows([9, 2, 3, 4, 5], 4, 4) is None  # another prompt: no kept rows


def test_kept_groups_are_bounded():
    prefixes = SharedPrefixes(kept_groups=2)
    for prompt in range(3):
        prefixes.keep([prompt, 1, 2], 2, torch.zeros(2, 1))
    assert prefixes.rows([0, 1, 2], 2, 2) is None  # the least recently used, dropped
    assert prefixes.rows([1, 1, 2], 2, 2) is not None and prefixes.rows([2, 1, 2], 2, 2) is not None  # two kept


def test_rows_at_the_edges_of_what_is_cached_and_kept():
    """Issue 105 item 10 (the mutation run): nothing cached past start - 2 needs no kept row, even for
    a group kept nowhere; a kept member whose ids end exactly where the cache ends covers it."""
    prefixes = SharedPrefixes()
    assert prefixes.rows([5, 6, 7, 8], 3, 2).numel() == 0  # positions 2.. computed: none needed, none kept
    states = torch.arange(8.0).reshape(4, 2)  # positions 2..5 of a member of 6 ids, start 3
    prefixes.keep([1, 2, 3, 4, 5, 6], 3, states)
    longer = [1, 2, 3, 4, 5, 6, 7, 8]  # agreeing with the kept member over its whole 6 ids
    assert torch.equal(prefixes.rows(longer, 3, 6), states[0:4])


def test_a_vllm_outside_the_tested_versions_is_refused_naming_them():
    check_vllm_version("0.32.0")
    check_vllm_version("0.32.1+cpu")
    for version in ("0.31.2", "0.33.0", "1.0.0"):
        with pytest.raises(RuntimeError, match=r"tested with vLLM 0\.32\.x only.*" + version.replace(".", r"\.")):
            check_vllm_version(version)


def test_the_command_refuses_a_missing_directory_and_a_key_among_the_engine_arguments(capsys, tmp_path):
    assert main(["serve-teacher", "/nonexistent/teacher", "--", "--dtype", "float32"]) == 2
    assert "MODEL_DIR '/nonexistent/teacher' is no directory" in capsys.readouterr().err
    assert main(["serve-teacher", str(tmp_path), "--", "--api-key=secret-words"]) == 2
    said = capsys.readouterr().err
    assert "--api-key is this command's, not an engine argument" in said and "secret-words" not in said


def test_a_server_that_shares_prefixes_is_sent_the_response_start_and_vllm_never():
    assert shares_prefix({"id": "m", "megatron_rl_patches": OURS})
    assert not shares_prefix({"id": "m"}) and not shares_prefix({"id": "m", "megatron_rl_patches": {"x": 1}})
    client = TeacherClient(URL, ClientSettings())
    ours, stock = ServedModel("m", 64, shares_prefix=True), ServedModel("m", 64)
    assert VllmEngine(client, 4, None).body(ours, [1, 2, 3], 2)["response_start"] == 2
    assert "response_start" not in VllmEngine(client, 4, None).body(stock, [1, 2, 3], 2)
    pooling = VllmPoolingEngine(client, 4, None, 8)
    assert pooling.body(ours, [1, 2, 3], 2)["response_start"] == 2 and "response_start" not in pooling.body(
        stock, [1, 2, 3], 2)


def test_a_pooling_reply_from_its_first_row_is_read():
    states = torch.randn(9, 8, generator=torch.Generator().manual_seed(1))
    sent = states[3:]  # serve-teacher told start 4: positions 3..8
    item = {"index": 0, "embed_dtype": "float32", "endianness": "little", "start": 0, "end": sent.numel() * 4,
            "shape": list(sent.shape), "first_row": 3}
    reply = SimpleNamespace(headers={"metadata": json.dumps({"data": [item]})},
                            content=sent.contiguous().view(torch.uint8).numpy().tobytes())
    pooling = VllmPoolingEngine(TeacherClient(URL, ClientSettings()), 4, None, 8)
    assert torch.equal(pooling.rows(reply, 9, 4, 0), states[3:8])
    with pytest.raises(Exception, match="first_row 5 is past the response's first row 3"):
        pooling.rows(SimpleNamespace(headers={"metadata": json.dumps({"data": [{**item, "first_row": 5}]})},
                                     content=reply.content), 9, 4, 0)


def test_serve_teacher_replicas_are_spread_by_prompt_affinity_unless_told():
    def spread(settings: ReplicaSettings, *cards: bool) -> object:
        replicas = [SimpleNamespace(url=f"{URL}{i}") for i in range(len(cards))]
        scheduler = Scheduler(replicas, settings, URL, lambda *_: None, None)  # type: ignore[arg-type]
        scheduler.connected({i: ServedModel("m", 64, shares_prefix=ours) for i, ours in enumerate(cards)}, {})
        return scheduler.spread

    assert isinstance(spread(ReplicaSettings(), True, True), PromptAffinity)
    assert type(spread(ReplicaSettings(), True, False)) is FewestInFlight  # a stock server among them
    assert type(spread(ReplicaSettings(spread=FewestInFlight()), True, True)) is FewestInFlight  # told


def test_the_block_is_the_smallest_the_cpu_runs_unless_given_and_the_start_line_names_what_it_shares():
    """Issue 105 item 8: vLLM's CPU default block of 128 shared nothing of a prompt under 128 tokens;
    serve-teacher asks for 32 on CPU (its attention's smallest), vLLM's own elsewhere (16 on a GPU),
    and its start-up line names the block and the shortest prompt it shares."""
    from megatron_rl_patches.apps.serve_teacher.engine import CPU_BLOCK, default_block_size
    from megatron_rl_patches.apps.serve_teacher.serving import start_line

    assert (CPU_BLOCK, default_block_size(True), default_block_size(False)) == (32, 32, None)
    assert start_line("m", "127.0.0.1", 8000, 32, False) == (
        "serve-teacher: m at http://127.0.0.1:8000 (prefix sharing on, KV blocks of 32 tokens: a group shares its "
        "prompt's whole blocks, so a prompt shares nothing under 32 tokens)")
    assert start_line("m", "0.0.0.0", 1, 128, True).endswith("under 128 tokens; API key required)")


@pytest.mark.parametrize(("host", "url"), [
    ("::1", "http://[::1]:8000"), ("::", "http://[::]:8000"), ("fe80::1%eth0", "http://[fe80::1%25eth0]:8000"),
    ("[::1]", "http://[::1]:8000"), ("127.0.0.1", "http://127.0.0.1:8000"),
    ("teacher.local", "http://teacher.local:8000"),
])
def test_the_start_line_names_a_url_a_client_takes_an_ipv6_host_in_brackets(host, url):
    """Issue 110 item 8: `--host ::1` printed `http://::1:8000`, no URL (ServedTeacher refuses it);
    an IPv6 address is bracketed (its zone's '%' escaped), and the URL printed is one the client
    takes as it is, naming the host back."""
    from urllib.parse import urlsplit

    from megatron_rl_patches.apps.serve_teacher.serving import start_line

    line = start_line("m", host, 8000, 32, False)
    assert line.startswith(f"serve-teacher: m at {url} (prefix sharing on")
    assert ServedTeacher(url, top_k=3).url == url
    assert urlsplit(url).hostname == host.strip("[]").replace("%", "%25") and urlsplit(url).port == 8000
