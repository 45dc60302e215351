"""The served lane (`make test-served`): one real vLLM server (its CPU build, in its own venv
named by MRP_VLLM_PYTHON) for the whole session, serving a tiny random Qwen3 that transformers
wrote (float32, every parameter perturbed) with a word-level tokenizer; the tests compare its
scores with transformers' own forward in this process; beside it, for hidden-state teachers, one
pooling server of the same checkpoint (started when a test first asks for it). Without
MRP_VLLM_PYTHON every test here skips (the main lane); with it, a server that does not start is an
error, never a skip."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest

from megatron_rl_patches.testing.hf_checkpoints import save_tiny_hf, save_word_tokenizer
from tests.teachers.lane.served_kit import (
    API_KEY,
    MAX_LOGPROBS,
    MAX_MODEL_LEN,
    MODEL_SHAPE,
    POOLING,
    VLLM_PYTHON,
    VOCAB,
)


def pytest_collection_modifyitems(items):
    for item in items:
        if "teachers/lane" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.served)
            if not VLLM_PYTHON:
                item.add_marker(pytest.mark.skip(reason="the served lane runs this (make test-served; "
                                                        "MRP_VLLM_PYTHON names vLLM's interpreter)"))


@dataclass(frozen=True)
class Served:
    url: str
    model: Any  # transformers' model of the checkpoint (float32, eval): the reference
    directory: Any
    process: Any  # the server's process (its group is the server)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """The lane's checkpoint (a tiny random Qwen3 with a word-level tokenizer) and transformers' model of it."""
    try:
        import httpx  # noqa: F401 - the client's library, the extra `served`
    except ImportError:
        pytest.fail("the served lane needs httpx in this venv: pip install -e '.[served]'")
    root = tmp_path_factory.mktemp("served")
    directory = root / "qwen3"
    model = save_tiny_hf(directory, "qwen3", seed=3, **MODEL_SHAPE)
    save_word_tokenizer(directory, VOCAB)
    return root, directory, model


@pytest.fixture(scope="session")
def served(checkpoint):
    """The session's vLLM server; its API key set in the client's variable for the session."""
    from megatron_rl_patches.testing.vllm_server import vllm_server

    root, directory, model = checkpoint
    with vllm_server(VLLM_PYTHON, directory, root / "vllm.log", max_model_len=MAX_MODEL_LEN,
                     max_logprobs=MAX_LOGPROBS, api_key=API_KEY) as server:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("MEGATRON_RL_PATCHES_TEACHER_API_KEY", API_KEY)
            yield Served(server.url, model, directory, server.process)


@pytest.fixture(scope="session")
def pooled(checkpoint):
    """The session's vLLM pooling server of the same checkpoint (hidden states: `--runner pooling
    --convert embed --pooler-config '{"task": "token_embed"}'`), started beside the generate one."""
    from megatron_rl_patches.testing.vllm_server import vllm_server

    root, directory, model = checkpoint
    with vllm_server(VLLM_PYTHON, directory, root / "vllm-pooling.log", max_model_len=MAX_MODEL_LEN,
                     max_logprobs=MAX_LOGPROBS, api_key=API_KEY, extra=POOLING) as server:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("MEGATRON_RL_PATCHES_TEACHER_API_KEY", API_KEY)
            yield Served(server.url, model, directory, server.process)
