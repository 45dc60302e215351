"""The package's logger, the rank-zero rule and once-per-process warnings. A leaf module: it
imports nothing of ours but the leaf `settings` (the launcher's rank), so every layer may use it."""
from __future__ import annotations

import logging
import sys
import threading

from megatron_rl_patches.settings import launcher_rank

logger = logging.getLogger("megatron_rl_patches")

_warned: set[str] = set()
_warned_lock = threading.Lock()


def is_rank_zero() -> bool:
    """Rank 0 of an initialized process group, else what the launcher says (no import of torch)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_rank() == 0
    except Exception:  # a half-torn-down process group: do not hide the warning
        return True
    return launcher_rank() == 0


def warn_once(message: str, every_rank: bool = False) -> None:
    """One warning line per distinct message per process, from rank 0 only (debug elsewhere); with
    `every_rank`, from each rank that says it (what happens on one rank only: a fallback on the last
    pipeline stage)."""
    with _warned_lock:
        if message in _warned:
            return
        _warned.add(message)
    if every_rank or is_rank_zero():
        logger.warning("megatron-rl-patches: %s", message)
    else:
        logger.debug("megatron-rl-patches: %s", message)


def forget_warnings() -> None:
    """Let every message warn again (test isolation)."""
    _warned.clear()
