"""A server that quotes the API key in a successful (200) reply: in a pooling reply's `metadata`
header, its `embed_dtype`, a prompt-logprobs key or value, a `/v1/models` card, a model's name or
root, `/tokenize`'s tokens. Whatever the status, every error the client builds passes through one
scrubber that knows the live key (`redaction.scrubbed`), and so does every line `doctor` prints:
no message holds 8 characters of the key in a row (`KEY_PIECE`), however a reply cut or split it."""
from __future__ import annotations

import json

import pytest

from megatron_rl_patches.teachers import ClientSettings, ServedTeacher, ServedTeacherError, TeacherBatch
from megatron_rl_patches.teachers.redaction import KEY_PIECE, scrubbed
from tests.teachers.local_servers import MAX_MODEL_LEN, MODEL, completions, url_of, vllm_like
from tests.teachers.test_teacher_step import H, head, pooled_states

pytest.importorskip("httpx", reason="the served extra (httpx) is missing")

KEY_VARIABLE, TEACHERS = "MEGATRON_RL_PATCHES_TEACHER_API_KEY", "MEGATRON_RL_PATCHES_OPD_TEACHERS"
# long enough that every cut quote (30, 40, 60, 80, 200 characters) holds more than a piece of it
KEY = "sk-live-0123456789abcdefghijklmnopqrstuvwxyzABCDEF"
SETTINGS = ClientSettings(retries=0, deadline_s=10)


def pieces(text: str, key: str = KEY) -> list[str]:
    """The pieces of `key` of `KEY_PIECE` characters `text` holds."""
    return [key[i:i + KEY_PIECE] for i in range(len(key) - KEY_PIECE + 1) if key[i:i + KEY_PIECE] in text]


@pytest.fixture
def key(monkeypatch):
    monkeypatch.delenv(TEACHERS, raising=False)
    monkeypatch.setenv(KEY_VARIABLE, KEY)
    return monkeypatch


def pooling_with(metadata=None, **fields):
    """A pooling route answering 200 with the item's `fields` replaced (`metadata`: the header whole)."""
    def answer(body):
        raw = pooled_states(body["input"]).numpy().tobytes()
        item = {"index": 0, "embed_dtype": "float32", "endianness": "little", "start": 0, "end": len(raw),
                "shape": [len(body["input"]), H], **fields}
        return 200, (raw, {"metadata": metadata or json.dumps({"data": [item]})})
    return answer


def logprobs_with(entry):
    """A completions route whose position 1 holds `entry` beside the real ones."""
    def answer(body):
        status, reply = completions(body)
        reply["choices"][0]["prompt_logprobs"][1].update(entry)
        return status, reply
    return answer


def cards(*card):
    return lambda _: (200, {"object": "list", "data": list(card)})


def card(name=MODEL, **fields):
    return {"id": name, "object": "model", "max_model_len": MAX_MODEL_LEN, **fields}


# (the routes of the stand-in server, whether it serves hidden states (a head), what the error says)
CASES = {
    "pooling metadata header": (dict(pooling=pooling_with(metadata=json.dumps({"data": [], "said": KEY}))), True,
                                "no binary pooling metadata"),
    "pooling embed_dtype": (dict(pooling=pooling_with(embed_dtype=KEY)), True, "the hidden states came as"),
    "pooling endianness": (dict(pooling=pooling_with(endianness=KEY)), True, "-endian"),
    "pooling shape": (dict(pooling=pooling_with(shape=[KEY, H])), True, "no [rows, width] of ints"),
    "prompt-logprobs key": (dict(v1_completions=logprobs_with({KEY: {"logprob": -1.0, "rank": 3}})), False,
                            "is no token id written plainly"),
    "prompt-logprobs value": (dict(v1_completions=logprobs_with({"1": {"logprob": KEY, "rank": 2}})), False,
                              "logprob is no number"),
    "models card": (dict(v1_models=cards({"object": "model", "owned_by": KEY})), False, "is no model card"),
    "model names": (dict(v1_models=cards(card(KEY), card("other"))), False, "serves 2 models"),
    "model without a length": (dict(v1_models=cards({"id": KEY, "object": "model"})), False, "no max_model_len"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_200_reply_quoting_the_key_is_quoted_without_it(case, key):
    routes, hidden, words = CASES[case]
    with vllm_like(**routes) as server, ServedTeacher(url_of(server), top_k=2, client=SETTINGS,
                                                      head=head() if hidden else None) as teacher:
        with pytest.raises(ServedTeacherError) as failed:
            teacher.check()
    said = str(failed.value)
    assert words in said and not pieces(said), said
    assert "***" in said, said  # what was hidden is said to be


def test_tokenize_quoting_the_key_is_quoted_without_it(key):
    with vllm_like(tokenize=lambda _: (200, {"tokens": [1, KEY]})) as server, \
            ServedTeacher(url_of(server), top_k=2, client=SETTINGS) as teacher:
        with pytest.raises(ServedTeacherError, match="tokens\\[1\\] is no token id") as failed:
            teacher.tokenize("t1 t2")
    assert not pieces(str(failed.value)) and "***" in str(failed.value), failed.value


def test_a_replica_whose_root_quotes_the_key_is_refused_without_it(key):
    # another max length (another root alone is one teacher now: replicas are compared by what they compute)
    with vllm_like(v1_models=cards(card(root="/ckpt/a"))) as a, \
            vllm_like(v1_models=cards(card(root=KEY, max_model_len=32))) as b, \
            ServedTeacher([url_of(a), url_of(b)], top_k=2, client=SETTINGS) as teacher:
        with pytest.raises(ServedTeacherError, match="the replicas of one teacher compute the same") as failed:
            teacher.check()
    assert not pieces(str(failed.value)) and "***" in str(failed.value), failed.value


def test_a_step_failing_on_a_reply_quoting_the_key_fails_without_it(key):
    """The error of a step (a sample's reply, after the connect succeeded) holds no piece either."""
    def later(body):  # the probe (2 ids) answered well, the sample's reply quoting the key (K + 1 entries)
        return completions(body) if len(body["prompt"]) == 2 else logprobs_with({KEY: {"logprob": -1.0}})(body)

    with vllm_like(v1_completions=later) as server, \
            ServedTeacher(url_of(server), top_k=3, client=SETTINGS) as teacher:
        import torch

        with pytest.raises(ServedTeacherError, match="\\(sample 0\\)") as failed:
            teacher.score(TeacherBatch([torch.tensor([1, 2, 3])], [1]))
    assert not pieces(str(failed.value)) and "***" in str(failed.value), failed.value


def test_doctor_shows_no_piece_of_the_key_a_200_reply_quotes(key, capsys):
    """A successful check's line (the served model's name) and a failing check's problem alike."""
    from megatron_rl_patches.apps.cli import main

    shown = []
    for routes in (dict(v1_models=cards(card(KEY))), CASES["prompt-logprobs key"][0]):
        with vllm_like(**routes) as server:
            key.setenv(TEACHERS, f"{url_of(server)};engine=vllm")
            for argv in (["doctor", "--json"], ["doctor"]):
                main(argv)
                out, err = capsys.readouterr()
                shown += [out, err]
    text = "\n".join(shown)
    assert "answers, serves '***'" in text and "is no token id written plainly" in text, text[-3000:]
    assert not pieces(text), [line for line in text.splitlines() if "***" in line or "sk-" in line]


def test_the_rule_no_8_characters_of_the_key_in_a_row(key):
    """However a reply cut or split the key: its first 40 characters, its halves apart, a piece at
    a quote's cut, JSON- or repr-escaped; a key shorter than 8 hidden whole; what is no piece kept."""
    assert scrubbed(f"got {KEY!r:.41}") == "got '***"  # its first 40 characters
    assert scrubbed(f"a {KEY[:20]} b {KEY[20:]} c") == "a *** b *** c"
    assert scrubbed(f"cut here: {KEY[:KEY_PIECE]}") == "cut here: ***"
    assert scrubbed(f"only {KEY[:KEY_PIECE - 1]}...") == f"only {KEY[:KEY_PIECE - 1]}..."  # 7 in a row: no piece
    assert scrubbed("no piece: sk-liveX 0123456X") == "no piece: sk-liveX 0123456X"
    odd = 'k3y"with\\quote-0123456789'
    key.setenv(KEY_VARIABLE, odd)
    assert not pieces(scrubbed(json.dumps({"said": odd}) + repr(odd)), odd)
    key.setenv(KEY_VARIABLE, "short")
    assert scrubbed("a short key, shortly") == "a *** key, ***ly"


def test_a_key_of_another_variable_is_scrubbed_too(monkeypatch):
    """`ClientSettings(api_key_env=...)`: the key of the variable a client reads is the live one."""
    monkeypatch.delenv(KEY_VARIABLE, raising=False)
    monkeypatch.setenv("MY_TEACHER_KEY", KEY)
    with vllm_like(tokenize=lambda _: (200, {"tokens": [KEY]})) as server, \
            ServedTeacher(url_of(server), top_k=2, client=ClientSettings(retries=0, api_key_env="MY_TEACHER_KEY")) \
            as teacher:
        with pytest.raises(ServedTeacherError) as failed:
            teacher.tokenize("t1")
    assert not pieces(str(failed.value)) and "***" in str(failed.value), failed.value
    assert [h.get("Authorization") for _, h in server.seen][:1] == [f"Bearer {KEY}"]
