"""Run a driver script in a fresh interpreter with MEGATRON_RL_PATCHES set, as a user's job would
start, and read back what it saved (`torch.save` of a dict to the path given as its argument)."""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_rl_patches.settings import child_environment


def run_with_patches(
    script: Path, out: Path, pythonpath: Sequence[Path | str], patches: str = "all", timeout: float = 300
) -> dict[str, Any]:
    """`python script out` with only MEGATRON_RL_PATCHES=`patches` of our variables and `pythonpath`;
    AssertionError with the stderr tail if it fails. The saved dict gains `status`: target -> status
    from its `statuses` (a list of PatchStatus.as_dict())."""
    env = child_environment({"MEGATRON_RL_PATCHES": patches, "PYTHONPATH": os.pathsep.join(map(str, pythonpath))},
                            ours=False)
    proc = subprocess.run(
        [sys.executable, str(script), str(out)],
        env=env, cwd=Path(out).parent, capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = torch.load(out, weights_only=False)
    result["status"] = {s["target"]: s["status"] for s in result.get("statuses", [])}
    return result
