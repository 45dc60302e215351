"""Suite-wide isolation (no patch of ours outlives a test), shared stand-ins, and helpers for
weights-only loading tests (model state snapshots, Megatron-LM style checkpoints)."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import settings

from megatron_rl_patches.testing import layouts, multirank

# CI runs the property tests with a fixed example sequence (a red run must mean a real failure
# that reproduces); locally they keep exploring new examples.
# max_examples is fixed so the property tests together stay under 60 s on the main lane.
settings.register_profile("ci", max_examples=150, derandomize=True, database=None, print_blob=True)
# `HYPOTHESIS_PROFILE=long`: a local soak of the property tests (tens of times more examples).
settings.register_profile("long", max_examples=3000, deadline=None, print_blob=True)
if os.environ.get("HYPOTHESIS_PROFILE"):
    settings.load_profile(os.environ["HYPOTHESIS_PROFILE"])
elif os.environ.get("CI"):
    settings.load_profile("ci")

# Every world's ranks fork from one server that imported torch and megatron-core once (each spawned
# rank paid 4-5 s of imports): still a fresh process per rank, the caller's environment and output.
multirank.use_forkserver()

# ---------------------------------------------------------------------------- the slime stand-in

STANDINS = Path(__file__).resolve().parent / "standins"
SLIME_STANDIN_MODEL = STANDINS / "slime" / "backends" / "megatron_utils" / "model.py"


def _slime_modules() -> list[str]:
    return [name for name in sys.modules if name.split(".")[0] == "slime"]


def write_slime_standin(root: Path, model_source: str | None = None) -> Path:
    """Copy the stand-in `slime` package (tests/standins/slime) under `root`, its model.py replaced
    by `model_source` when given (a variant: a renamed function, a changed signature); returns `root`."""
    shutil.copytree(STANDINS / "slime", root / "slime", ignore=shutil.ignore_patterns("__pycache__"),
                    dirs_exist_ok=True)
    if model_source is not None:
        (root / SLIME_STANDIN_MODEL.relative_to(STANDINS)).write_text(model_source)
    return root


@pytest.fixture(scope="session")
def slime_standin_writer():
    """`write_slime_standin(root, model_source=None) -> root`, for any fixture scope."""
    return write_slime_standin


@pytest.fixture(scope="session")
def slime_standin_source() -> str:
    """The source of the stand-in's `slime.backends.megatron_utils.model`."""
    return SLIME_STANDIN_MODEL.read_text()


@pytest.fixture
def slime_standin(monkeypatch):
    """The stand-in `slime` package importable (tests/standins on sys.path, returned); `slime`
    modules imported before are set aside meanwhile and the stand-in's are dropped afterwards."""
    saved = {name: sys.modules.pop(name) for name in _slime_modules()}
    monkeypatch.syspath_prepend(str(STANDINS))
    yield STANDINS
    for name in _slime_modules():
        del sys.modules[name]
    sys.modules.update(saved)


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

    from megatron_rl_patches.model.chunks import unwrap

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

    from megatron_rl_patches.model.chunks import unwrap

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


# ---------------------------------------------------------------------------- built wheel

REPO = Path(__file__).resolve().parents[1]
# What a wheel is built from (a copy: pip writes egg-info and build/ into the tree it builds).
WHEEL_SOURCES = ("setup.py", "setup.cfg", "pyproject.toml", "README.md", "LICENSE", "startup", "megatron_rl_patches")
# Left in the copy's build/lib as an earlier build of an older tree would: none may ship.
STALE_BUILD_FILES = ("megatron_rl_patches/apps/cli.py", "megatron_rl_patches/_removed_module.py")


def copy_source_tree(dest: Path) -> Path:
    """Copy what a wheel is built from into `dest` (no caches, no egg-info); returns `dest`."""
    for name in WHEEL_SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
        elif path.exists():
            shutil.copy2(path, dest / name)
    return dest


@pytest.fixture(scope="session")
def source_tree_copier():
    """`copy_source_tree(dest) -> dest`, for fixtures of any scope."""
    return copy_source_tree


def _build_tools_missing() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    try:
        setuptools = Version(version("setuptools"))
    except PackageNotFoundError:
        return "setuptools is not installed in this venv"
    if setuptools < Version("64"):
        return f"setuptools {setuptools} < 64"
    if setuptools < Version("70.1"):  # older setuptools build wheels through the `wheel` package
        try:
            version("wheel")
        except PackageNotFoundError:
            return "the `wheel` package is not installed in this venv"
    return None


@pytest.fixture(scope="session")
def built_wheel(tmp_path_factory) -> SimpleNamespace:
    """One wheel per session, built from a copy of the tree whose build/lib holds stale modules of
    an earlier build: `.path` (the .whl), `.source` (the copy it was built from) and `.stale` (the
    stale modules' paths under build/lib)."""
    import subprocess

    missing = _build_tools_missing()
    if missing:
        pytest.skip(f"cannot build the wheel without isolation: {missing}")
    src = copy_source_tree(tmp_path_factory.mktemp("src"))
    for name in STALE_BUILD_FILES:
        stale = src / "build" / "lib" / name
        stale.parent.mkdir(parents=True, exist_ok=True)
        stale.write_text("raise ImportError('a stale module from an earlier build')\n")
    out = tmp_path_factory.mktemp("wheelhouse")
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "MEGATRON_RL_PATCHES"))}
    environ.update(PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)],
        env=environ, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (path,) = out.glob("megatron_rl_patches-*.whl")
    return SimpleNamespace(path=path, source=src, stale=STALE_BUILD_FILES)


# ---------------------------------------------------------------------------- the GPU lane


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` run only where torch sees a CUDA device (`make test-gpu`); elsewhere
    they are skipped, never needed by `make test`. A test that runs once per model kind
    (`megatron_cpu_kind`) carries `layout("hybrid")` in its HybridModel run (docs/layouts.md); a
    `layout(...)` marker naming no layout of megatron_rl_patches.testing.layouts, or a layout proof
    marked `version_blind` or `reader_facing` (fewer lanes), stops the session. The heaviest modules
    come first (kit/heavy_first.py: the lanes' xdist workers take them first)."""
    from kit.heavy_first import heavy_first

    heavy_first(items)
    for item in items:
        if getattr(getattr(item, "callspec", None), "params", {}).get("megatron_cpu_kind") == "hybrid":
            item.add_marker(layouts.mark("hybrid"))
    problems = layouts.marker_problems(items)
    if problems:
        raise pytest.UsageError("layout(...) markers naming no layout of testing/layouts.py:\n" + "\n".join(problems))
    # a layout's proof runs on every lane whose megatron-core has the feature (docs/layouts.md)
    narrowed = [item.nodeid for item in items if item.get_closest_marker("layout")
                and (item.get_closest_marker("version_blind") or item.get_closest_marker("reader_facing"))]
    if narrowed:
        raise pytest.UsageError("layout(...) proofs marked version_blind or reader_facing (a layout's proof runs on "
                                "every megatron lane):\n" + "\n".join(narrowed))
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: run `make test-gpu` on a GPU machine")
    for item in gpu_items:
        item.add_marker(skip)


def _ddp_anywhere(chunk) -> bool:
    import torch
    from megatron.core.distributed import DistributedDataParallel

    ddp_types = (DistributedDataParallel, torch.nn.parallel.DistributedDataParallel)
    return any(isinstance(m, ddp_types) for m in chunk.modules())


@pytest.fixture
def ddp_anywhere():
    """`ddp_anywhere(chunk) -> bool`: a DDP wrapper (megatron-core's or torch's) anywhere in the chunk."""
    return _ddp_anywhere


@pytest.fixture
def moe_router_on_cpu(monkeypatch):
    """megatron-core < 0.17 without Transformer Engine names `te_general_gemm` in its router's
    gating linear without defining it (NameError): define it as absent, as its import fallback meant."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        monkeypatch.setattr(moe_utils, "te_general_gemm", None, raising=False)
