"""pytest plugin (entry point `pytest11`): fixtures to test Megatron RL pipelines on CPU.

Loaded in every pytest session of every user, so importing it imports nothing heavy; torch and
megatron load only when a fixture is used. pytest-mock is optional.
"""
# lazy imports: import cost: pytest loads this plugin (pytest11) in every session of an environment with the package
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from megatron_rl_patches.testing.fake_ddp import FakeDDP


@pytest.fixture
def megatron_cpu() -> Iterator[Any]:
    """Real megatron-core on CPU: gloo world of size 1, parallel state (TP=PP=1), CPU shims.
    Yields a `MegatronCPU` handle (gpt, ddp, batch, run_schedule, sgd_step...); all torn down after."""
    pytest.importorskip("megatron.core")
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    with megatron_on_cpu() as env:
        yield env


@pytest.fixture
def tiny_gpt(megatron_cpu: Any) -> Callable[..., Any]:
    """Factory of a tiny real GPTModel: `tiny_gpt(vocab_size=64, seq_length=16, seed=0, ...)`."""
    return megatron_cpu.gpt


@pytest.fixture(params=("gpt", "hybrid"))
def megatron_cpu_kind(request: pytest.FixtureRequest, megatron_cpu: Any) -> Any:
    """`megatron_cpu` once per model kind: its `model()` / `model_provider()` build a tiny GPTModel,
    then a tiny HybridModel (attention + MLP layers); skipped where megatron-core lacks the kind."""
    from megatron_rl_patches.testing.megatron_cpu import ModelKindUnavailable

    try:
        return megatron_cpu.with_kind(request.param)
    except ModelKindUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture
def fake_ddp(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """Factory of DDP stand-ins; with pytest-mock installed their hook and sync methods are spies."""
    try:
        mocker = request.getfixturevalue("mocker")
    except pytest.FixtureLookupError:
        mocker = None

    def make(*args: Any, **kwargs: Any) -> FakeDDP:
        ddp = FakeDDP(*args, **kwargs)
        if mocker is not None:
            for name in ("enable_forward_pre_hook", "disable_forward_pre_hook", "start_param_sync", "start_grad_sync"):
                mocker.spy(ddp, name)
        return ddp

    return make
