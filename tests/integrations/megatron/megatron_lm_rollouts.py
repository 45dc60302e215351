"""Subprocess check of `train_reentry` on the real Megatron-LM train():
``python megatron_lm_rollouts.py OUT.pt`` with MEGATRON_RL_PATCHES set patches at start-up, runs
three rollouts (one train() call each), then reverts and runs the by-hand control."""
from __future__ import annotations

import sys


def main(out: str) -> None:
    from megatron_rl_patches.patching.startup import hook as bootstrap

    bootstrap.run()  # what the installed .pth does at start-up (not installed in a dev checkout)

    import torch

    import megatron_rl_patches
    from megatron_rl_patches.testing.megatron_lm import megatron_lm_session, run_rollouts

    patched, error = None, None
    with megatron_lm_session() as session:
        try:
            patched = run_rollouts(session)
        except Exception as exc:  # reported to the test, which shows it
            error = f"{type(exc).__name__}: {exc}"
        statuses = [status.as_dict() for status in megatron_rl_patches.applied()]
        megatron_rl_patches.revert()
        control = run_rollouts(session, by_hand=True)
    torch.save({"statuses": statuses, "patched": patched, "error": error, "control": control}, out)


if __name__ == "__main__":
    main(sys.argv[1])
