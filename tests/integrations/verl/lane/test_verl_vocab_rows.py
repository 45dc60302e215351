"""The whole-vocabulary route asks a served teacher for the rows verl reads only, on verl 0.9.1's
trainer batch (`kit.rl_batch`: built through verl's own `left_right_2_no_padding`, where
`loss_mask` is the padded, response-aligned `response_mask`): each sequence's scored rows start at
its prompt's length, and the hidden states the route receives (and projects through both heads)
are the responses' rows, counted at a stand-in pooling server."""
from __future__ import annotations

import importlib.util
import json
import pathlib
import types

import pytest
import torch

pytest.importorskip("verl.models", reason="verl is not installed: run `make test-verl` (the verl lane)")
pytestmark = pytest.mark.verl

import verl_kit as kit  # noqa: E402

from megatron_rl_patches.integrations.verl import vocab  # noqa: E402
from megatron_rl_patches.integrations.verl.entry import parse_entry  # noqa: E402
from megatron_rl_patches.teachers import TeacherHead  # noqa: E402

# the suite's stand-in vLLM server, by its path: verl's lane installs a `tests` package of its own
_SPEC = importlib.util.spec_from_file_location("local_servers", pathlib.Path(__file__).parents[3] / "teachers" /
                                               "local_servers.py")
assert _SPEC is not None and _SPEC.loader is not None
servers = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(servers)

H = 8
PROMPTS, RESPONSES = (5, 3, 13), (10, 9, 8)  # 48 tokens: 45 rows after each first, 27 response rows


def pooling(body):
    """vLLM's binary pooling reply: [T, H] float32 states, row p from position p alone."""
    count = len(body["input"])
    raw = (torch.arange(count, dtype=torch.float32)[:, None] + torch.arange(H) / 100).numpy().tobytes()
    item = {"index": 0, "embed_dtype": "float32", "endianness": "little", "start": 0, "end": len(raw),
            "shape": [count, H]}
    return 200, (raw, {"metadata": json.dumps({"data": [item]})})


def test_the_served_rows_are_the_responses_verl_reads():
    batch = kit.rl_batch(PROMPTS, RESPONSES)
    assert not batch["loss_mask"].is_nested and batch["loss_mask"].shape == (3, max(RESPONSES))  # verl's layout
    assert vocab.response_starts(batch) == list(PROMPTS)
    head = TeacherHead(weight=torch.zeros(kit.VOCAB, H), vocab_size=kit.VOCAB, padded_vocab_size=kit.VOCAB, first_id=0)
    with servers.vllm_like(pooling=pooling) as server:
        raw = f"{servers.url_of(server)};engine=vllm;head=/unused"
        engine = types.SimpleNamespace()  # verl's engine: holds the teacher it builds
        states, starts = vocab.teacher_rows(engine, raw, parse_entry(raw), head, batch, None)
        asked = [body for path, body in server.seen if path == "/pooling"]
    read = int(batch["response_mask"].sum())  # what verl's losses read
    assert read == 27 and sum(s.shape[0] for s in states) == read  # not 45: no prompt row
    assert starts == list(PROMPTS) and len(asked) == 1 + 3  # the probe and one request per sequence
    for rows, prompt in zip(states, PROMPTS):  # row r: the state that predicts token prompt + r
        assert rows[:, 0].tolist() == list(range(prompt - 1, prompt - 1 + rows.shape[0]))
