"""fp8 hidden states from a real vLLM pooling server (the session's float32 one, conftest.py
`pooled`): `ServedTeacher(hidden_dtype=torch.float8_e4m3fn / float8_e5m2)` asks vLLM 0.32's
`embed_dtype` fp8_e4m3 / fp8_e5m2 and decodes one byte a value, bit for bit the same request's JSON
reply (`encoding_format: float`) cast to that fp8 dtype as the server casts; the head's log-probs
from those states stay within fp8's rounding of the float32 states' (the table in
docs/distillation.md measures it on a real checkpoint), a row shifted by one does not."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.teachers import ClientSettings, ServedTeacher, TeacherBatch, TeacherHead
from tests.teachers.lane.served_kit import API_KEY, VOCAB

FAST = ClientSettings(retries=1, backoff_s=0.1, deadline_s=60.0)


def json_states(url: str, directory, ids: torch.Tensor) -> torch.Tensor:
    """The server's JSON reply for `ids`: every position's state [T, H], float32."""
    httpx = pytest.importorskip("httpx", reason="the served extra (httpx) is missing")
    reply = httpx.post(f"{url}/pooling", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
                       json={"model": str(directory), "input": ids.tolist(), "task": "token_embed",
                             "use_activation": False, "encoding_format": "float", "add_special_tokens": False})
    reply.raise_for_status()
    return torch.tensor(reply.json()["data"][0]["data"], dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_states_are_the_json_reply_cast_bit_for_bit(pooled, dtype):
    gen = torch.Generator().manual_seed(11)
    batch = TeacherBatch([torch.randint(0, VOCAB, (n,), generator=gen) for n in (30, 7)], [5, 1])
    head = TeacherHead.from_hf(pooled.directory)
    with ServedTeacher(pooled.url, head=head, top_k=VOCAB - 1, hidden_dtype=dtype, client=FAST) as teacher:
        scores = teacher.score(batch)
    assert scores.hidden_states is not None
    for i, (ids, start) in enumerate(zip(batch.sequences, batch.response_starts)):
        rows = json_states(pooled.url, pooled.directory, ids)[start - 1:-1]
        got = scores.hidden_states[i]
        assert got.dtype == dtype and got.shape == rows.shape
        assert torch.equal(got.view(torch.uint8), rows.to(dtype).view(torch.uint8)), f"sample {i}"
        assert not torch.equal(got[1:].view(torch.uint8), rows[:-1].to(dtype).view(torch.uint8))  # shifted: differs
        want = torch.log_softmax(rows.double() @ head.weight.double().T, dim=-1).gather(1, ids[start:, None])[:, 0]
        error = (scores.token_log_probs[i] - want).abs().max().item()
        assert 0 < error < 0.5, f"sample {i}: {error}"  # fp8's rounding of the states, not a wrong row
