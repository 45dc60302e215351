"""The served lane (`make test-served`): one real vLLM server (its CPU build, in its own venv
named by MRP_VLLM_PYTHON) for the whole session, serving a tiny random Qwen3 that transformers
wrote (float32, every parameter perturbed) with a word-level tokenizer; the tests compare its
scores with transformers' own forward in this process; beside it, for hidden-state teachers, one
pooling server of the same checkpoint, a server without a tokenizer and a bf16 pooling server; for
a teacher's replicas, a spare generate server of a byte copy of the checkpoint at another path (its
prefix cache on; paused, then killed); for the head's logit scale, a generate server of a tiny
random Cohere whose config.json omits logit_scale (the engine's 0.0625 default) and a pooling
server of it (`served_extra`: only with MRP_SERVED_EXTRA=1).
Every server the session's tests use starts together, when the first is asked for (`launched`); a
module's servers of its own load in the background once those are ready (`early_work`). Without
MRP_VLLM_PYTHON every test here skips (the main lane); with it, a server that does not start is an
error, never a skip."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from megatron_rl_patches.testing.hf_checkpoints import save_tiny_hf, save_word_tokenizer
from tests.teachers.lane.early_work import JOBS, EarlyWork
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
    # a test that kills a shared server runs after the rest, in any selection of modules (the lane's
    # file order had put them last; a subset given in another order failed every test after them);
    # before those, the modules that offer work of their own (early_work): it loads meanwhile
    items.sort(key=lambda item: (killed_last(item), offers_work(item)))
    for item in items:
        if "teachers/lane" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.served)
            if not VLLM_PYTHON:
                item.add_marker(pytest.mark.skip(reason="the served lane runs this (make test-served; "
                                                        "MRP_VLLM_PYTHON names vLLM's interpreter)"))
            elif item.get_closest_marker("served_extra") and not EXTRA:
                item.add_marker(pytest.mark.skip(reason="servers of its own past the served lane's time budget: "
                                                        "MRP_SERVED_EXTRA=1 make test-served runs it"))


def offers_work(item: pytest.Item) -> bool:
    """Whether the item's module offers work of its own to begin early (`early_work.offer`)."""
    return any(job.module == item.module.__name__ for job in JOBS.values())


def killed_last(item: pytest.Item) -> int:
    """0: kills no shared server; 1: kills one; 2: kills `served`, which the others' tests use too."""
    kills = item.get_closest_marker("kills_server")
    return 0 if kills is None else 2 if kills.args == ("served",) else 1


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


def bf16_checkpoint(root: Path) -> Path:
    """A tiny random Qwen3 saved in bf16 (config.json's dtype and the tensors) with the lane's word
    tokenizer (another seed than the lane's checkpoint)."""
    import torch

    model = save_tiny_hf(root / "float32", "qwen3", seed=6, **MODEL_SHAPE)
    directory = root / "qwen3-bf16"
    model.to(torch.bfloat16).save_pretrained(directory)
    save_word_tokenizer(directory, VOCAB)
    return directory


def cohere_checkpoint(root: Path) -> Path:
    """A tiny random Cohere (Command R: logits × logit_scale, which config.json omits here, so the
    engine uses its 0.0625 default), untied: a stored lm_head.weight unlike the embeddings, which
    vLLM 0.32's commandr.py drops (it projects through the embeddings whatever config.json says),
    with the lane's word tokenizer (issue 86 item 11)."""
    import json

    import torch
    import transformers

    directory = root / "cohere"
    if (directory / "config.json").exists():
        return directory
    config = transformers.CohereConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=MAX_MODEL_LEN, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2, pad_token_id=0)
    torch.manual_seed(13)
    model = transformers.CohereForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():  # random, norms about 1 (a norm left at 1 hides nothing here)
            param.copy_(torch.randn_like(param) * 0.2 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(directory)
    save_word_tokenizer(directory, VOCAB)
    written = json.loads((directory / "config.json").read_text())
    del written["logit_scale"]  # omitted: the engine's default applies
    (directory / "config.json").write_text(json.dumps(written))
    return directory


def spare_copy(root: Path, directory: Path) -> Path:
    """A byte copy of the lane's checkpoint at another path (the spare replica serves it)."""
    import shutil

    copy = root / "qwen3-copy"
    if not copy.exists():
        shutil.copytree(directory, copy)
    return copy


def start(name: str, root: Path, directory: Path) -> Any:
    """The lane's server `name` started (not waited for): its model directory and options."""
    from megatron_rl_patches.testing.vllm_server import launch

    common = dict(max_model_len=MAX_MODEL_LEN, max_logprobs=MAX_LOGPROBS)
    if name == "served":
        return launch(VLLM_PYTHON, directory, root / "vllm.log", api_key=API_KEY, **common)
    if name == "spare":  # the same weights from a byte copy at another path, its prefix cache on (issue 86 items 1, 2)
        return launch(VLLM_PYTHON, spare_copy(root, directory), root / "vllm-spare.log", api_key=API_KEY,
                      extra=("--enable-prefix-caching",), **common)
    if name == "ours":  # megatron-rl-patches serve-teacher: vLLM's engine in process, a group's prefix once (issue 98);
        # its KV block its CPU default (OURS_BLOCK), no logprobs limit but the vocabulary (issue 105 items 1, 8)
        return launch(VLLM_PYTHON, directory, root / "serve-teacher.log", api_key=API_KEY, serve_teacher=True,
                      max_model_len=MAX_MODEL_LEN, max_logprobs=-1)
    if name == "pooled":
        return launch(VLLM_PYTHON, directory, root / "vllm-pooling.log", api_key=API_KEY, extra=POOLING, **common)
    if name == "cohere":  # a family whose engine scales its logits by a default (issue 86 item 11)
        return launch(VLLM_PYTHON, cohere_checkpoint(root), root / "vllm-cohere.log", **common)
    if name == "cohere_pooled":
        return launch(VLLM_PYTHON, cohere_checkpoint(root), root / "vllm-cohere-pooling.log", extra=POOLING, **common)
    if name == "tokenizerless":  # as slime starts its own engines: no tokenizer, so no /tokenize
        return launch(VLLM_PYTHON, directory, root / "vllm-tokenizerless.log", extra=("--skip-tokenizer-init",),
                      **common)
    assert name == "bf16_pooled", name
    return launch(VLLM_PYTHON, bf16_checkpoint(root), root / "vllm-bf16.log", api_key=API_KEY, extra=POOLING,
                  dtype="bfloat16", max_model_len=MAX_MODEL_LEN)


SERVERS = ("served", "ours", "pooled", "tokenizerless", "bf16_pooled", "spare", "cohere", "cohere_pooled")
# a module marked served_extra starts servers of its own past the lane's time budget: run with this set
EXTRA = bool(os.environ.get("MRP_SERVED_EXTRA"))


@pytest.fixture(scope="session")
def launched(request, checkpoint):
    """Every server the session's tests use, started when the first is asked for: as many at once as
    the machine's available memory takes with room to spare (`servers_that_fit`; all five on a 24 GiB
    machine), the next wave once those are ready (they load side by side, which the lane's cores
    finish sooner than one after another); each fixture below takes its own and stops it. Once
    they are ready, the modules' own work (`early_work`) is begun in the background."""
    from megatron_rl_patches.testing.vllm_server import servers_that_fit, stop, wait_ready

    running = [item for item in request.session.items if not item.get_closest_marker("skip")]
    wanted = {name for item in running for name in item.fixturenames}
    root, directory, _ = checkpoint
    names = [name for name in SERVERS if name in wanted]
    wave = servers_that_fit(len(names)) if names else 1
    servers: dict[str, Any] = {}
    early = None
    try:
        for at in range(0, len(names), wave):
            if at:  # the earlier wave loaded: its peak is behind it
                for server in servers.values():
                    wait_ready(server, 600.0)
            for name in names[at: at + wave]:
                servers[name] = STARTED[name] = start(name, root, directory)
        shared = list(servers.values())
        modules = list(dict.fromkeys(item.module.__name__ for item in running))
        jobs = [name for module in modules for name, job in JOBS.items() if job.module == module]

        def shared_ready() -> None:
            for server in shared:
                wait_ready(server, 600.0)

        early = EARLY["work"] = EarlyWork(jobs, root, directory, shared_ready)
        yield servers
    finally:
        if early is not None:
            early.close()
        for server in servers.values():
            stop(server.process)


# the session's `EarlyWork` (made by `launched`)
EARLY: dict[str, EarlyWork] = {}


@pytest.fixture(scope="session")
def early_work(launched) -> EarlyWork:
    """The lane's modules' own work, begun in the background once the shared servers are ready
    (`early_work`): a module's fixture takes its job's handle (`early_work.take(name)`)."""
    return EARLY["work"]


# every lane server started this session, by name: a failing test is told which of them died
STARTED: dict[str, Any] = {}
# the replica tests pause and kill this one on purpose
KILLED_ON_PURPOSE = ("spare",)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing lane test whose server died (a signal, not an exception: the client sees only
    "Connection refused") says which server, how, and where its log is."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    notes = [f"{name}: {said}" for name, server in STARTED.items()
             if name not in KILLED_ON_PURPOSE and (said := server.death()) is not None]
    if notes:
        report.sections.append(("lane servers that died", "\n\n".join(notes)))


def ready(launched: dict[str, Any], name: str, checkpoint: Any) -> Any:
    """`name`'s server, ready (started now when the session did not list it)."""
    from megatron_rl_patches.testing.vllm_server import serving

    root, directory, _ = checkpoint
    server = launched.pop(name, None)
    if server is None:
        server = STARTED[name] = start(name, root, directory)
    return serving(server)


@pytest.fixture(scope="session")
def served(launched, checkpoint):
    """The session's vLLM server; its API key set in the client's variable for the session."""
    _, directory, model = checkpoint
    with ready(launched, "served", checkpoint) as server:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("MEGATRON_RL_PATCHES_TEACHER_API_KEY", API_KEY)
            yield Served(server.url, model, directory, server.process)


@pytest.fixture(scope="session")
def pooled(launched, checkpoint):
    """The session's vLLM pooling server of the same checkpoint (hidden states: `--runner pooling
    --convert embed --pooler-config '{"task": "token_embed"}'`), started beside the generate one."""
    _, directory, model = checkpoint
    with ready(launched, "pooled", checkpoint) as server:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("MEGATRON_RL_PATCHES_TEACHER_API_KEY", API_KEY)
            yield Served(server.url, model, directory, server.process)


@pytest.fixture(scope="session")
def ours(launched, checkpoint):
    """`megatron-rl-patches serve-teacher` of the lane's checkpoint (its prefix cache on, blocks of
    OURS_BLOCK tokens: its CPU default; `--max-logprobs -1`); the API key set in the client's variable."""
    _, directory, model = checkpoint
    with ready(launched, "ours", checkpoint) as server:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("MEGATRON_RL_PATCHES_TEACHER_API_KEY", API_KEY)
            yield Served(server.url, model, directory, server.process)


@pytest.fixture(scope="session")
def tokenizerless(launched, checkpoint):
    """A server of the lane's checkpoint started with `--skip-tokenizer-init` (as slime starts its
    own engines): (url, the directory, whose tokenizer is the student's)."""
    with ready(launched, "tokenizerless", checkpoint) as server:
        yield server.url, checkpoint[1]


@pytest.fixture(scope="session")
def bf16_pooled(launched, checkpoint):
    """A pooling server in bfloat16 of a bf16 checkpoint: (url, its directory); the API key set."""
    with ready(launched, "bf16_pooled", checkpoint) as server:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("MEGATRON_RL_PATCHES_TEACHER_API_KEY", API_KEY)
            yield server.url, checkpoint[0] / "qwen3-bf16"


@pytest.fixture(scope="session")
def cohere(launched, checkpoint):
    """A generate server of a tiny random Cohere whose config.json omits logit_scale: (url, its directory)."""
    with ready(launched, "cohere", checkpoint) as server:
        yield server.url, checkpoint[0] / "cohere"


@pytest.fixture(scope="session")
def cohere_pooled(launched, checkpoint):
    """A pooling server of the same Cohere (its final hidden states per token): its url."""
    with ready(launched, "cohere_pooled", checkpoint) as server:
        yield server.url


@pytest.fixture(scope="session")
def spare(launched, checkpoint):
    """A second generate server of the lane's checkpoint from a byte copy at another path (a
    replica beside `served`), its prefix cache on, for the replica tests alone: they pause it and
    kill it (last)."""
    with ready(launched, "spare", checkpoint) as server:
        yield server
