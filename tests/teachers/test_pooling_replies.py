"""The pooling engine's reading of vLLM's binary `/pooling` replies, written here in vLLM 0.32's shape
(a `metadata` header with each input's dtype, endianness, byte range and shape; the rows' raw
values as the body) beside the served lane, which reads a real server's: only the response's rows
decoded, bf16 bit for bit, and a reply with the wrong rows, width, dtype or a non-finite value
refused naming the sample. And the arguments of a hidden-state teacher, refused by name."""
from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch

from megatron_rl_patches.teachers import (
    ClientSettings,
    ServedTeacher,
    ServedTeacherError,
    ServedTeacherRefusal,
    TeacherBatch,
)
from megatron_rl_patches.teachers.served.engines.vllm_pooling import VllmPoolingEngine
from megatron_rl_patches.teachers.served.http import TeacherClient

URL = "http://127.0.0.1:9"
NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
         torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def engine(width: int, dtype: torch.dtype = torch.float32) -> VllmPoolingEngine:
    return VllmPoolingEngine(TeacherClient(URL, ClientSettings()), 4, None, width, dtype)


def engine_of(teacher: ServedTeacher) -> VllmPoolingEngine:
    """The engine asking the teacher's one server."""
    return teacher.endpoint.replicas[0].engine


def reply(states: torch.Tensor, name: str | None = None, shape: list[int] | None = None, offset: int = 0,
          endianness: str = "little") -> SimpleNamespace:
    """A binary pooling reply of one input as vLLM writes it (after `offset` bytes of padding)."""
    body = states.contiguous().view(torch.uint8).numpy().tobytes()
    item = {"index": 0, "embed_dtype": name or NAMES[states.dtype], "endianness": endianness, "start": offset,
            "end": offset + len(body), "shape": shape or list(states.shape)}
    return SimpleNamespace(headers={"metadata": json.dumps({"data": [item]})}, content=b"\0" * offset + body)


def test_only_the_response_rows_are_decoded_bit_for_bit():
    states = torch.randn(9, 8, generator=torch.Generator().manual_seed(0))
    rows = engine(8).rows(reply(states, offset=16), 9, 4, 2)
    assert torch.equal(rows, states[3:8])  # row r: position start - 1 + r predicts token start + r
    half = states.bfloat16()
    assert torch.equal(engine(8, torch.bfloat16).rows(reply(half), 9, 1, 0), half[:8])
    assert engine(8).rows(reply(states), 9, 9, 0).shape == (0, 8)


@pytest.mark.parametrize(("make", "words"), [
    (lambda s: reply(s[:5]), "9 ids sent but hidden states of shape \\[5, 8\\]"),
    (lambda s: reply(torch.zeros(9, 6)), "width 6 came back, but the teacher's head has hidden size 8"),
    (lambda s: reply(s.half()), "came as 'float16', not the 'float32' asked"),
    (lambda s: reply(s, endianness="big"), "'big'-endian"),
    (lambda s: reply(s.index_fill(0, torch.tensor([5]), float("nan"))), "row 2 \\(position 5\\) is not finite"),
    (lambda s: SimpleNamespace(headers={}, content=b""), "no binary pooling metadata"),
    (lambda s: SimpleNamespace(headers={"metadata": "{}"}, content=b""), "no binary pooling metadata"),
    (lambda s: SimpleNamespace(headers={"metadata": "{not json"}, content=b""), "the reply's metadata header "),
])
def test_bad_replies_are_refused_naming_the_sample(make, words):
    states = torch.randn(9, 8, generator=torch.Generator().manual_seed(1))
    with pytest.raises(ServedTeacherError, match=f"\\(sample 3\\): .*{words}") as caught:
        engine(8).rows(make(states), 9, 4, 3)
    assert (caught.value.url, caught.value.sample) == (URL, 3)


def test_every_non_finite_row_is_found_and_finite_extremes_pass():
    """The reply is checked by one sum first: an infinity, two infinities of either sign and a NaN
    are refused at their row; finite values whose sum overflows still pass, bit for bit."""
    states = torch.randn(9, 8, generator=torch.Generator().manual_seed(3))
    for bad, row in ((torch.tensor([float("inf")]), 6), (torch.tensor([float("inf"), -float("inf")]), 5)):
        broken = states.clone()
        broken[row, : bad.numel()] = bad
        with pytest.raises(ServedTeacherError, match=f"position {row}\\) is not finite"):
            engine(8).rows(reply(broken), 9, 1, 0)
    huge = torch.full((9, 8), 3.0e38)
    assert torch.equal(engine(8).rows(reply(huge), 9, 1, 0), huge[:8])
    half = torch.full((9, 8), 3.0e38).bfloat16()
    assert torch.equal(engine(8, torch.bfloat16).rows(reply(half), 9, 1, 0), half[:8])


def ranged(states: torch.Tensor, start: object, end: object, shape: object = None) -> SimpleNamespace:
    """A well-formed reply whose metadata names another byte range (or shape)."""
    good = reply(states)
    item = json.loads(good.headers["metadata"])["data"][0]
    item.update(start=start, end=end, **({} if shape is None else {"shape": shape}))
    return SimpleNamespace(headers={"metadata": json.dumps({"data": [item]})}, content=good.content)


BODY = 9 * 8 * 4  # the bytes of a 9 x 8 float32 reply


@pytest.mark.parametrize(("start", "end", "shape"), [
    (-BODY + 4, 4, None),  # read from 4 bytes into the body before: states 2.63 off, no error
    (-BODY - 8, -8, None),  # a bare torch RuntimeError before
    (4, BODY + 4, None),  # past the body's end
    (8, 4, None),  # backwards
    (True, BODY + 1, None),  # a bool is no offset
    (0.0, float(BODY), None),  # nor a float
    (0, BODY, [9, True]),  # nor a bool width (True == 1)
    (0, BODY, [9.0, 8]),  # nor a float row count
], ids=["negative-inside", "negative-outside", "past-the-end", "backwards", "bool", "float", "bool-width",
        "float-rows"])
def test_every_byte_range_is_checked_against_the_body(start, end, shape):
    states = torch.randn(9, 8, generator=torch.Generator().manual_seed(4))
    with pytest.raises(ServedTeacherError, match=rf"{URL}/pooling \(sample 5\): ") as caught:
        engine(8).rows(ranged(states, start, end, shape), 9, 2, 5)
    assert (caught.value.url, caught.value.sample) == (URL, 5)
    assert type(caught.value) is ServedTeacherError  # a reply's fault, never a refusal to fix the request
    assert torch.equal(engine(8).rows(ranged(states, 0, BODY), 9, 2, 5), states[1:8])


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_fp8_states_are_decoded_as_vllm_encodes_them(dtype):
    """vLLM 0.32 writes fp8 as `tensor.to(dtype)` viewed as uint8, one byte a value (endianness moot):
    decoded bit for bit; the request names vLLM's embed_dtype; e4m3fn saturates at +-448 in that cast,
    e5m2 overflows to an infinity (refused naming the row), a NaN byte is refused in both."""
    states = torch.randn(9, 8, generator=torch.Generator().manual_seed(4)) * 3
    sent = states.to(dtype)
    rows = engine(8, dtype).rows(reply(sent, offset=3), 9, 2, 0)
    assert rows.dtype == dtype and torch.equal(rows.view(torch.uint8), sent[1:8].view(torch.uint8))
    stock = SimpleNamespace(name="m", shares_prefix=False)
    assert engine(8, dtype).body(stock, [1, 2], 1)["embed_dtype"] == NAMES[dtype]
    big = states.index_fill(0, torch.tensor([4]), 1e6).to(dtype)
    if dtype == torch.float8_e4m3fn:
        assert engine(8, dtype).rows(reply(big), 9, 1, 0)[4].float().eq(448).all()
    else:
        with pytest.raises(ServedTeacherError, match="row 3 \\(position 4\\) is not finite"):
            engine(8, dtype).rows(reply(big), 9, 2, 0)
    nan = sent.clone()
    nan.view(torch.uint8)[6, 2] = 0x7F  # a NaN in both formats
    with pytest.raises(ServedTeacherError, match="row 5 \\(position 6\\) is not finite"):
        engine(8, dtype).rows(reply(nan), 9, 2, 0)


def test_a_truncated_body_is_refused():
    good = reply(torch.ones(9, 8))
    cut = SimpleNamespace(headers=good.headers, content=good.content[:-4])
    with pytest.raises(ServedTeacherError, match="do not hold 9 x 8 float32 values"):
        engine(8).rows(cut, 9, 1, 0)


@pytest.fixture(scope="module")
def head():
    pytest.importorskip("safetensors")
    from megatron_rl_patches.teachers import TeacherHead

    weight = torch.randn(50, 8, generator=torch.Generator().manual_seed(2))
    return TeacherHead(weight, 50, 50, 0, source="test")


def test_hidden_state_teacher_arguments_are_named(head, tmp_path):
    from megatron_rl_patches.teachers import TeacherHead

    with pytest.raises(ValueError, match="SGLang's hidden states .*return_hidden_states.* stay refused"):
        ServedTeacher(URL, "sglang", head=head)
    with pytest.raises(ValueError, match="temperature=...\\) must be a finite number > 0"):
        ServedTeacher(URL, head=head, temperature=0.0)
    with pytest.raises(ValueError, match="top_k=50\\) must be smaller than the teacher head's vocabulary of 50"):
        ServedTeacher(URL, head=head, top_k=50)
    with pytest.raises(TypeError, match="head=...\\) must be a TeacherHead"):
        ServedTeacher(URL, head=3)
    with pytest.raises(ValueError, match="hidden_dtype"):
        ServedTeacher(URL, head=head, hidden_dtype=torch.float64)
    with pytest.raises(FileNotFoundError, match="TeacherHead.from_hf\\(path\\)"):
        ServedTeacher(URL, head=tmp_path / "nowhere")
    teacher = ServedTeacher(URL, head=head, top_k=49, temperature=0.7)  # any K of the vocabulary, any temperature
    assert teacher.temperature == 0.7 and engine_of(teacher).dtype == torch.float32
    for dtype in FP8:  # asked only: never the default, even for a checkpoint that names fp8
        assert engine_of(ServedTeacher(URL, head=head, hidden_dtype=dtype)).dtype == dtype
        fp8_named = TeacherHead(head.weight, 50, 50, 0, source="test", checkpoint_dtype=dtype)
        assert engine_of(ServedTeacher(URL, head=fp8_named)).dtype == torch.float32
    bf16_named = TeacherHead(head.weight, 50, 50, 0, source="test", checkpoint_dtype=torch.bfloat16)
    assert engine_of(ServedTeacher(URL, head=bf16_named)).dtype == torch.bfloat16  # the model's own: exact
    assert engine_of(ServedTeacher(URL, head=head, model="b")).model == "b"  # the model asked of a server of several


def test_score_arguments_are_refused_before_anything_is_sent(head):
    """Nothing listens at URL: a refusal here comes before any request."""
    batch = TeacherBatch([torch.arange(6), torch.arange(4)], [2, 4])
    with ServedTeacher(URL, head=head, client=ClientSettings(retries=0, deadline_s=5)) as teacher:
        for ids, shown in ((torch.zeros(2, 4, 2), "Tensor"), ([torch.zeros(4, 2, dtype=torch.long)], "list of 1")):
            with pytest.raises(TypeError, match=r"score\(ids=...\) must be a list of 2 id tensors \[R_i, k\] \(one per "
                                                rf"sample: the ids to score on each response row\), got {shown}$"):
                teacher.score(batch, ids=ids)
        with pytest.raises(ValueError, match="sample 0's ids must be an integer tensor \\[4, k\\]"):
            teacher.score(batch, ids=[torch.zeros(3, 2, dtype=torch.long), torch.zeros(0, 2, dtype=torch.long)])
        with pytest.raises(ValueError, match="sample 0 holds ids outside \\[0, 50\\)"):
            teacher.score(batch, ids=[torch.full((4, 2), 60), torch.zeros(0, 2, dtype=torch.long)])
        outside = "sample 1 holds id 70, outside the teacher head's vocabulary of 50"
        with pytest.raises(ServedTeacherRefusal, match=outside) as caught:
            teacher.score(TeacherBatch([torch.arange(6), torch.tensor([1, 70])], [2, 1]))
        assert (caught.value.url, caught.value.sample) == (URL, 1)
    with ServedTeacher(URL, client=ClientSettings(retries=0, deadline_s=5)) as plain:
        with pytest.raises(ValueError, match="ids=...\\) needs a head"):
            plain.score(batch, ids=[torch.zeros(4, 2, dtype=torch.long), torch.zeros(0, 2, dtype=torch.long)])


@pytest.mark.parametrize(("given", "words"), [
    (torch.zeros(4, 2, dtype=torch.complex64), r"sample 1's ids must be an integer tensor \[4, k\].*complex64"),
    (torch.tensor([[1, 2], [3, 4], [5, 5], [6, 7]]), r"sample 1's row 2 holds id 5 twice"),
    (torch.tensor([[1, 2, 1], [3, 4, 0], [5, 6, 7], [8, 9, 3]], dtype=torch.int32), r"sample 1's row 0 holds id 1 "
                                                                                    r"twice"),
])
def test_ids_the_op_would_refuse_are_refused_naming_the_sample_before_anything_is_sent(head, given, words):
    """Nothing listens at URL: a ValueError here comes before any request (the op refused repeated
    ids only after every pooling request was sent, naming no sample)."""
    batch = TeacherBatch([torch.arange(3), torch.arange(6)], [2, 2])
    first = torch.zeros(1, given.shape[1], dtype=torch.long) + torch.arange(given.shape[1])
    with ServedTeacher(URL, head=head, client=ClientSettings(retries=0, deadline_s=5)) as teacher:
        with pytest.raises(ValueError, match=rf"ServedTeacher.score\(ids=...\): {words}"):
            teacher.score(batch, ids=[first, given])


def test_a_temperature_the_heads_ops_cannot_compute_is_refused_at_construction(head):
    """`temperature=1e50` passed "finite, > 0", and the head's top-k log-probs and tails came back
    NaN from about 1e46 (1/τ underflows float32); at the largest accepted one they are finite and
    float64's (uniform to 1e-37 there)."""
    from megatron_rl_patches.ops._checks import largest_temperature, smallest_temperature

    largest, smallest = largest_temperature(torch.float32), smallest_temperature(torch.float32)
    for tau in (largest * (1 + 2**-20), 1e46, 1e50, smallest * (1 - 2**-20)):
        words = rf"ServedTeacher\(temperature={re.escape(repr(tau))}\) is outside the temperatures the head's ops "
        with pytest.raises(ValueError, match=words + r"compute: \[4\.2397e-39, 8\.50705e\+37\]"):
            ServedTeacher(URL, head=head, temperature=tau)
    teacher = ServedTeacher(URL, head=head, top_k=4, temperature=largest)
    hidden = torch.randn(3, 8, generator=torch.Generator().manual_seed(6))
    ids, values, tail = head.topk(hidden, 4, teacher.temperature)
    logp = torch.log_softmax((hidden.double() @ head.weight.double().T) / largest, dim=1)
    torch.testing.assert_close(values.double(), logp.gather(1, ids), atol=1e-6, rtol=0)
    torch.testing.assert_close(tail.double(), torch.log1p(-logp.gather(1, ids).exp().sum(1)), atol=1e-6, rtol=0)
