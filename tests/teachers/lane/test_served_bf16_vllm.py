"""A bf16-served teacher's hidden states (issue 74 item 5): a real vLLM pooling server of a bf16
checkpoint started with `--dtype bfloat16` (its CPU build); the binary reply a `ServedTeacher` with
the checkpoint's head asks by default (`embed_dtype` bfloat16, the model's dtype: 2H bytes a token)
equals the same request's JSON reply (`encoding_format: float`) rounded to bf16, bit for bit, for
every sample; and the head's log-probs from those states (the whole vocabulary: K = V - 1 and the
tail, the actual tokens) against a dense float64 log-softmax over the same states and the bf16
head, within 1e-5 through a float32 head and within bf16's rounding through the checkpoint's bf16
head. A negative control: the JSON reply of the row after (a shift by one) is far from equal."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.teachers import ClientSettings, ServedTeacher, TeacherBatch, TeacherHead
from tests.teachers.lane.served_kit import API_KEY, VOCAB

FAST = ClientSettings(retries=1, backoff_s=0.1, deadline_s=60.0)


def json_states(url: str, directory, ids: torch.Tensor) -> torch.Tensor:
    """The server's JSON ("float") reply for `ids`: every position's state [T, H], float32."""
    httpx = pytest.importorskip("httpx", reason="the served extra (httpx) is missing")
    reply = httpx.post(f"{url}/pooling", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
                       json={"model": str(directory), "input": ids.tolist(), "task": "token_embed",
                             "use_activation": False, "encoding_format": "float", "add_special_tokens": False})
    reply.raise_for_status()
    return torch.tensor(reply.json()["data"][0]["data"], dtype=torch.float32)


def test_the_binary_bf16_reply_is_the_json_reply_rounded_bit_for_bit_and_the_head_scores_it(bf16_pooled):
    url, directory = bf16_pooled
    gen = torch.Generator().manual_seed(8)
    batch = TeacherBatch([torch.randint(0, VOCAB, (n,), generator=gen) for n in (9, 60, 3)], [2, 30, 1])
    head = TeacherHead.from_hf(directory)  # the checkpoint's dtype: bf16, the states asked in it
    assert head.checkpoint_dtype == torch.bfloat16 and head.dtype == torch.bfloat16
    with ServedTeacher(url, head=head, top_k=VOCAB - 1, client=FAST) as teacher:
        scores = teacher.score(batch)
    head32 = TeacherHead.from_hf(directory, dtype=torch.float32)
    with ServedTeacher(url, head=head32, top_k=VOCAB - 1, hidden_dtype=torch.bfloat16, client=FAST) as teacher:
        scores32 = teacher.score(batch)
    assert scores.hidden_states is not None and scores32.hidden_states is not None
    worst32 = worst16 = 0.0
    for i, (ids, start) in enumerate(zip(batch.sequences, batch.response_starts)):
        got = scores.hidden_states[i]
        as_json = json_states(url, directory, ids)
        rows = as_json[start - 1:-1]  # row r predicts token start + r
        assert got.dtype == torch.bfloat16 and got.shape == rows.shape
        assert torch.equal(got.view(torch.int16), rows.bfloat16().view(torch.int16)), f"sample {i}"
        assert torch.equal(rows.bfloat16().float(), rows)  # the JSON values are bf16 values already
        assert torch.equal(scores32.hidden_states[i], got)  # the same request, the same bits
        if rows.shape[0] > 1:  # a negative control: one row shifted
            assert not torch.equal(got[1:].view(torch.int16), rows[:-1].bfloat16().view(torch.int16))
        # the whole vocabulary through the head against float64 over the same states and weights
        want = torch.log_softmax(got.double() @ head32.weight.double().T, dim=-1)
        for values, tol in ((scores32, 1e-5), (scores, 0.0)):
            every = torch.full_like(want, torch.nan).scatter_(1, values.topk_ids[i], values.topk_log_probs[i])
            every[every.isnan()] = values.tail_log_probs[i]
            error = (every - want).abs().max().item()
            tokens = ids[start:]
            error = max(error, (values.token_log_probs[i] - want.gather(1, tokens[:, None])[:, 0]).abs().max().item())
            if tol:
                worst32 = max(worst32, error)
                assert error <= tol, f"sample {i}: float32 head {error:.2e}"
            else:
                worst16 = max(worst16, error)
    print(f"bf16-served pooling: binary bf16 reply == JSON rounded to bf16, bit for bit ({len(batch)} samples); "
          f"the head's log-probs vs float64: float32 head {worst32:.2e}, bf16 head {worst16:.2e}")
    assert worst16 < 0.1  # the bf16 head's own rounding (bf16 products), not a wrong row
