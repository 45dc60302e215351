"""Suite-wide isolation (no patch of ours outlives a test), shared stand-ins, and helpers for
weights-only loading tests (model state snapshots, Megatron-LM style checkpoints)."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import settings

# CI runs the property tests with a fixed example sequence (a red run must mean a real failure
# that reproduces); locally they keep exploring new examples.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
# `HYPOTHESIS_PROFILE=long`: a local soak of the property tests (tens of times more examples).
settings.register_profile("long", max_examples=3000, deadline=None, print_blob=True)
if os.environ.get("HYPOTHESIS_PROFILE"):
    settings.load_profile(os.environ["HYPOTHESIS_PROFILE"])
elif os.environ.get("CI"):
    settings.load_profile("ci")

# The smallest module with slime's train() and hook-helper signatures (patch `train_reentry`).
FAKE_SLIME_MODEL = '''
def train(rollout_id, model, optimizer, opt_param_scheduler, data_iterator, num_microbatches,
          global_batch_sizes):
    return "original"


def enable_forward_pre_hook(model_chunks):
    return "original"


def disable_forward_pre_hook(model_chunks, param_sync=True):
    return "original"
'''


def write_fake_slime(root: Path, model_source: str = FAKE_SLIME_MODEL) -> Path:
    """Write `slime/backends/megatron_utils/model.py` (with package inits) under `root`."""
    pkg = root / "slime" / "backends" / "megatron_utils"
    pkg.mkdir(parents=True, exist_ok=True)
    for folder in (root / "slime", root / "slime" / "backends", pkg):
        (folder / "__init__.py").write_text("")
    (pkg / "model.py").write_text(model_source)
    return root


@pytest.fixture(scope="session")
def fake_slime_writer():
    """`write_fake_slime(root, model_source=FAKE_SLIME_MODEL) -> root`, for any fixture scope."""
    return write_fake_slime


@pytest.fixture(scope="session")
def fake_slime_source() -> str:
    return FAKE_SLIME_MODEL


@pytest.fixture
def clean_patch_state(monkeypatch):
    """No MEGATRON_RL_PATCHES* variable set and a fresh registry, before and after the test."""
    for name in [n for n in os.environ if n.startswith("MEGATRON_RL_PATCHES")]:
        monkeypatch.delenv(name, raising=False)
    from megatron_rl_patches._log import forget_warnings
    from megatron_rl_patches.integrations import default_registry

    default_registry().reset()
    forget_warnings()
    yield monkeypatch
    default_registry().reset()
    forget_warnings()


@pytest.fixture(autouse=True)
def _reset_patch_registry():
    """No patch of the default registry outlives a test (only when the test built one)."""
    yield
    integrations = sys.modules.get("megatron_rl_patches.integrations")
    if integrations is not None and integrations._default is not None:
        integrations._default.reset()
    log = sys.modules.get("megatron_rl_patches._log")
    if log is not None:
        log.forget_warnings()


# ---------------------------------------------------------------------------- weights-only loading


def model_state(module: Any) -> dict:
    """Clones of the tensors in the (unwrapped) model's state dict."""
    import torch

    from megatron_rl_patches._chunks import unwrap

    return {k: v.detach().clone() for k, v in unwrap(module).state_dict().items() if isinstance(v, torch.Tensor)}


def assert_same_state(a: dict, b: dict) -> None:
    """Same keys, bitwise equal tensors."""
    import torch

    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def save_checkpoint(model: Any, root: Any, iteration: int, **common: Any) -> Any:
    """A Megatron-LM checkpoint root (tracker file, iter_XXXXXXX) holding the model under "model",
    optimizer and RNG state, pickled `args` and the extra `common` entries; returns the iter dir."""
    import argparse

    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    from megatron_rl_patches._chunks import unwrap

    path = root / f"iter_{iteration:07d}"
    path.mkdir(parents=True)
    word = unwrap(model).embedding.word_embeddings.weight
    state = {
        "model": unwrap(model).sharded_state_dict(),
        "optimizer": {
            "exp_avg": ShardedTensor.from_rank_offsets(
                "optimizer.state.exp_avg.embedding.word_embeddings.weight", torch.ones_like(word), replica_id=0
            )
        },
        "rng_state": ShardedObject("rng_state", {"seed": 1}, (1,), (0,), replica_id=0),
        "args": argparse.Namespace(lr=1e-5, finetune=False),
        "iteration": iteration,
        **common,
    }
    dist_checkpointing.save(state, str(path))
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return path


@pytest.fixture
def weights_kit() -> SimpleNamespace:
    """`state(module)`, `assert_same(a, b)`, `save(model, root, iteration, **common) -> iter dir`."""
    return SimpleNamespace(state=model_state, assert_same=assert_same_state, save=save_checkpoint)
