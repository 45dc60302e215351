"""The verl lane (`make test-verl`): verl 0.9.1's real engine, model-forward and distillation
code on tiny packed GPTModels on CPU. Every module here is marked `verl` and skips cleanly where
verl is not importable (the main lanes). The modules skip on `verl.models`, not `verl`: where
verl is missing, tests/integrations/ on sys.path makes tests/integrations/verl/ a namespace
package `verl` (a real verl, a regular package, always wins over it)."""
from __future__ import annotations

import pytest


@pytest.fixture
def verl_cpu(clean_patch_state):
    """Megatron on CPU (gloo, parallel state, CPU shims); no patch applied before or after."""
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    with megatron_on_cpu() as env:
        yield env
