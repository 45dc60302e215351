"""The NeMo-RL lane (`make test-nemo NEMO_RL=...`): NeMo-RL 7ea279ab's own Megatron driver,
post-processors, model_utils and losses on CPU over megatron-core 0.19.2 (Python 3.12), its
service imports on the kit's inert stand-ins (megatron_rl_patches.testing.service_stubs). Skips
loudly where NeMo-RL's source is not on the path (every other lane)."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

HERE = os.path.dirname(__file__)
SKIP = "*** SKIPPED LANE nemo-rl: nemo_rl is not importable; run `make test-nemo NEMO_RL=/path/to/NeMo-RL` ***"
AVAILABLE = importlib.util.find_spec("nemo_rl") is not None

if AVAILABLE:
    sys.path.insert(0, HERE)
    from megatron_rl_patches.testing.service_stubs import install_service_stubs

    install_service_stubs()  # before anything imports NeMo-RL


def pytest_report_header(config):
    return None if AVAILABLE else SKIP


@pytest.fixture
def nemo_cpu(clean_patch_state):
    """Megatron on CPU (gloo, parallel state, CPU shims); no patch applied before or after."""
    if not AVAILABLE:
        pytest.skip(SKIP)
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    with megatron_on_cpu() as env:
        yield env
