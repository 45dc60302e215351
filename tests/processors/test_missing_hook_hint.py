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
    import json, logging, sys
    records = []
    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())
    logging.getLogger("megatron_rl_patches").addHandler(Keep())
    import megatron.core.models.gpt.gpt_model as gpt
    import megatron_rl_patches
    if sys.argv[1] == "patched":
        megatron_rl_patches.apply(only=["gpt_output_processor"])
    native = "output_processor" in __import__("inspect").signature(gpt.GPTModel.forward).parameters
    megatron_rl_patches.log_prob_output_processor()
    megatron_rl_patches.topk_output_processor(k=2)
    print(json.dumps({"native": native, "hints": [r for r in records if "gpt_output_processor" in r]}))
""")


def _run(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_RL_PATCHES")}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_missing_patch_is_named_once_and_not_when_applied():
    plain, patched = _run("plain"), _run("patched")
    assert patched["hints"] == []
    if plain["native"]:  # megatron-core >= 0.18: nothing is missing
        assert plain["hints"] == []
    else:
        assert len(plain["hints"]) == 1 and "apply(only=['gpt_output_processor'])" in plain["hints"][0]
