"""A logit scale read where the engine reads it, against real servers (issue 86 item 11): a tiny
random Cohere whose config.json omits `logit_scale`, served twice by vLLM 0.32 (generate, pooling;
commandr.py multiplies its logits by `config.logit_scale`, CohereConfig's default 0.0625 where
config.json omits it). The pooled states through `TeacherHead.from_hf` of that directory (0.0625
applied in the head) give the generate server's prompt log-probs within 1e-4; the same states
through the unscaled output layer (a reading that finds no field and applies nothing) are far off.
Two servers of their own, past the lane's time budget: `served_extra` (MRP_SERVED_EXTRA=1).

Why Cohere and not a Llama with an outer `logit_scale` and another in a `text_config` (the
disagreement item 11 names): vLLM 0.32 refuses to serve a Llama whose config.json holds a
`text_config` (its `ModelConfig`: "The text_config extracted from the model config does not have
`num_attention_heads`": transformers keeps it a dict), so no CPU server disagrees with itself there;
a Llama with an outer scale alone is `test_served_logit_scale_vllm.py`. The states come from the
pooling server of the same checkpoint. The checkpoint is untied (a stored `lm_head.weight` unlike
its embeddings): vLLM 0.32's commandr.py projects through the embeddings and drops it, and so must
the head (`head_transforms.EMBEDDING_OUTPUT`; read from `lm_head.weight` it missed the server by
0.36 nats)."""
from __future__ import annotations

import json

import pytest
import torch

from megatron_rl_patches.teachers import ClientSettings, ServedTeacher, TeacherBatch, TeacherHead
from tests.teachers.lane.served_kit import MAX_LOGPROBS, VOCAB

pytestmark = pytest.mark.served_extra
FAST = ClientSettings(retries=1, backoff_s=0.1, deadline_s=120.0)


def test_a_default_logit_scale_is_the_heads_as_the_engine_applies_it(cohere, cohere_pooled, monkeypatch):
    url, directory = cohere
    monkeypatch.delenv("MEGATRON_RL_PATCHES_TEACHER_API_KEY", raising=False)  # these two servers want none
    assert "logit_scale" not in json.loads((directory / "config.json").read_text())
    gen = torch.Generator().manual_seed(4)
    batch = TeacherBatch([torch.randint(3, VOCAB, (n,), generator=gen) for n in (30, 12)], [10, 2])
    with ServedTeacher(url, top_k=MAX_LOGPROBS, client=FAST) as teacher:
        engine = teacher.score(batch)
    with ServedTeacher(cohere_pooled, head=directory, top_k=MAX_LOGPROBS, client=FAST) as teacher:
        assert teacher.head is not None and teacher.head.logit_scale == 0.0625
        through_head = teacher.score(batch)
    unscaled_weight = TeacherHead.from_hf(directory).weight / 0.0625  # the output layer as written
    off = 0.0
    for i in range(len(batch)):
        for field in ("token_log_probs", "topk_log_probs"):
            torch.testing.assert_close(getattr(through_head, field)[i].double(), getattr(engine, field)[i].double(),
                                       atol=1e-4, rtol=0)
        assert torch.equal(through_head.topk_ids[i][:, :5], engine.topk_ids[i][:, :5])
        tokens = batch.sequences[i][batch.response_starts[i]:]
        plain = torch.log_softmax((through_head.hidden_states[i].double() @ unscaled_weight.double().T), -1)
        off = max(off, float((plain.gather(1, tokens[:, None])[:, 0] - engine.token_log_probs[i].double()).abs().max()))
    assert off > 0.05, off  # without the scale the head is another distribution
    print(f"Cohere, logit_scale omitted: head (0.0625) vs vLLM's prompt log-probs within 1e-4; unscaled {off:.3f} "
          "nats off")
