"""The pooling engine's reading of vLLM's binary `/pooling` replies, written here in vLLM 0.32's shape
(a `metadata` header with each input's dtype, endianness, byte range and shape; the rows' raw
values as the body) beside the served lane, which reads a real server's: only the response's rows
decoded, bf16 bit for bit, and a reply with the wrong rows, width, dtype or a non-finite value
refused naming the sample. And the arguments of a hidden-state teacher, refused by name."""
from __future__ import annotations

import json
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
from megatron_rl_patches.teachers.engines.vllm_pooling import VllmPoolingEngine
from megatron_rl_patches.teachers.http_client import TeacherClient

URL = "http://127.0.0.1:9"
NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
         torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def engine(width: int, dtype: torch.dtype = torch.float32) -> VllmPoolingEngine:
    return VllmPoolingEngine(TeacherClient(URL, ClientSettings()), 4, None, width, dtype)


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
])
def test_bad_replies_are_refused_naming_the_sample(make, words):
    states = torch.randn(9, 8, generator=torch.Generator().manual_seed(1))
    with pytest.raises(ServedTeacherError, match=f"\\(sample 3\\): .*{words}") as caught:
        engine(8).rows(make(states), 9, 4, 3)
    assert caught.value.sample == 3


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


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_fp8_states_are_decoded_as_vllm_encodes_them(dtype):
    """vLLM 0.32 writes fp8 as `tensor.to(dtype)` viewed as uint8, one byte a value (endianness moot):
    decoded bit for bit; the request names vLLM's embed_dtype; e4m3fn saturates at +-448 in that cast,
    e5m2 overflows to an infinity (refused naming the row), a NaN byte is refused in both."""
    states = torch.randn(9, 8, generator=torch.Generator().manual_seed(4)) * 3
    sent = states.to(dtype)
    rows = engine(8, dtype).rows(reply(sent, offset=3), 9, 2, 0)
    assert rows.dtype == dtype and torch.equal(rows.view(torch.uint8), sent[1:8].view(torch.uint8))
    assert engine(8, dtype).body(SimpleNamespace(name="m"), [1, 2])["embed_dtype"] == NAMES[dtype]
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
    assert teacher.temperature == 0.7 and teacher.engine.dtype == torch.float32
    for dtype in FP8:  # asked only: never the default, even for a checkpoint that names fp8
        assert ServedTeacher(URL, head=head, hidden_dtype=dtype).engine.dtype == dtype
        fp8_named = TeacherHead(head.weight, 50, 50, 0, source="test", checkpoint_dtype=dtype)
        assert ServedTeacher(URL, head=fp8_named).engine.dtype == torch.float32
    bf16_named = TeacherHead(head.weight, 50, 50, 0, source="test", checkpoint_dtype=torch.bfloat16)
    assert ServedTeacher(URL, head=bf16_named).engine.dtype == torch.bfloat16  # the model's own: exact
    assert ServedTeacher(URL, head=head, model="b").engine.model == "b"  # the model asked of a server of several


def test_score_arguments_are_refused_before_anything_is_sent(head):
    """Nothing listens at URL: a refusal here comes before any request."""
    batch = TeacherBatch([torch.arange(6), torch.arange(4)], [2, 4])
    with ServedTeacher(URL, head=head, client=ClientSettings(retries=0, deadline_s=5)) as teacher:
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
