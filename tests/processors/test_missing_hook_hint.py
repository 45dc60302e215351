"""A processor built where GPTModel cannot take it (megatron-core < 0.18, patch not applied) says
which patch to apply, once, instead of leaving the user with GPTModel's bare TypeError."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.megatron

SCRIPT = textwrap.dedent("""
    import json, logging
    records = []
    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())
    logging.getLogger("megatron_rl_patches").addHandler(Keep())
    import megatron.core.models.gpt.gpt_model as gpt
    import megatron_rl_patches
    def build():
        megatron_rl_patches.log_prob_output_processor()
        megatron_rl_patches.topk_output_processor(k=2)
        return [r for r in records if "gpt_output_processor" in r]
    megatron_rl_patches.apply(only=["gpt_output_processor"])
    native = "output_processor" in __import__("inspect").signature(gpt.GPTModel.forward).parameters
    patched = build()
    megatron_rl_patches.revert()
    native_plain = "output_processor" in __import__("inspect").signature(gpt.GPTModel.forward).parameters
    build()
    plain = build()  # built twice without the patch: the hint still comes once
    print(json.dumps({"native": native_plain, "patched_signature": native, "patched": patched, "plain": plain}))
""")


def test_the_missing_patch_is_named_once_and_not_when_applied():
    """One process (a fresh interpreter: the hint comes once per process): processors built with
    the patch applied give no hint; reverted, built twice, they give exactly one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_RL_PATCHES")}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["patched_signature"] and result["patched"] == []
    if result["native"]:  # megatron-core >= 0.18: nothing is missing
        assert result["plain"] == []
    else:
        assert len(result["plain"]) == 1 and "apply(only=['gpt_output_processor'])" in result["plain"][0]
