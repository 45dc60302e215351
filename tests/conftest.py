"""Suite-wide isolation: every test starts and ends with no patch of ours applied."""
import pytest


@pytest.fixture(autouse=True)
def _reset_patch_registry():
    yield
    import sys

    registry = sys.modules.get("megatron_rl_patches.patching.registry")
    if registry is not None:
        registry._reset_for_tests()
