"""The slime lane (`make test-slime SLIME=... MEGATRON_LM=...`): slime 624b824a's real train(),
forward_only and losses on CPU over real megatron-core 0.16.1 (its GPT model and MTP modules with
slime's own Megatron patch applied, slime_megatron_patch.py) and Megatron-LM 1dcf0daf's
`megatron/training`. Skips loudly where slime is not importable (every other lane)."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

HERE = os.path.dirname(__file__)
SKIP = ("*** SKIPPED LANE slime: slime is not importable; run `make test-slime SLIME=/path/to/slime "
        "MEGATRON_LM=/path/to/Megatron-LM` ***")
_SPEC = importlib.util.find_spec("slime")
# the real source (the main suite's stand-ins in tests/standins/slime say STAND_IN = True)
AVAILABLE = _SPEC is not None and os.path.isfile(
    os.path.join(os.path.dirname(_SPEC.origin or ""), "backends", "megatron_utils", "actor.py")) and \
    "STAND_IN = True" not in open(_SPEC.origin or os.devnull).read()

if AVAILABLE:
    sys.path.insert(0, HERE)
    import slime_megatron_patch
    import slime_standins

    slime_megatron_patch.install()  # slime's GPT-model hunks, as slime's image runs Megatron
    slime_standins.install()
    # a forkserver's ranks would hold megatron-core's own GPT model, imported before the patch
    from megatron_rl_patches.testing import multirank

    multirank.use_spawn()


def pytest_report_header(config):
    return None if AVAILABLE else SKIP


@pytest.fixture
def slime_cpu(clean_patch_state):
    """Megatron on CPU (gloo, parallel state, CPU shims) and slime's CPU accelerator."""
    if not AVAILABLE:
        pytest.skip(SKIP)
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    slime_standins.cpu_accelerator()
    with megatron_on_cpu() as env:
        yield env
