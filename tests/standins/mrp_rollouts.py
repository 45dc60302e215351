"""Rollout drivers shared by the in-process re-entrant train() tests and their subprocess run.

Run as a script (``python tests/standins/mrp_rollouts.py OUT.pt``) it is the subprocess check:
patches from the environment (MEGATRON_RL_PATCHES), then an unpatched by-hand control.
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

OVERLAP = dict(overlap_grad_reduce=True, use_distributed_optimizer=True, overlap_param_gather=True)
STEPS, MICROBATCHES, ROLLOUTS = 2, 2, 3


def build_chunks(handle: Any, num_chunks: int = 1, seed: int = 0) -> list[Any]:
    """Real DDP chunks around tiny models of the handle's kind sharing one TransformerConfig, as
    virtual-pipeline chunks do."""
    config = handle.config()
    return [handle.ddp(handle.model(config, seed=seed + i), **OVERLAP) for i in range(num_chunks)]


def rollout_data(rollout_id: int, handle: Any) -> list[list[dict]]:
    """STEPS steps of MICROBATCHES micro-batches, different for every rollout."""
    return [
        [handle.batch(seed=100 * rollout_id + 10 * step + mb) for mb in range(MICROBATCHES)] for step in range(STEPS)
    ]


def run_rollout(train: Callable[..., Any], rollout_id: int, chunks: list[Any], handle: Any, lr: float = 0.1) -> Any:
    from slime.backends.megatron_utils import model as slime_model

    data = rollout_data(rollout_id, handle)
    return train(rollout_id, chunks, slime_model.MainGradSGD(lr), None, data, [len(step) for step in data])


def rebuild_by_hand(chunks: Sequence[Any]) -> None:
    """The control: what a user had to do between rollouts without the patches."""
    config = chunks[0].config
    config.no_sync_func = config.grad_sync_func = config.param_sync_func = None
    for chunk in chunks:
        if not chunk.remove_forward_pre_hook_handles:
            chunk.enable_forward_pre_hook()


def run_rollouts(
    train: Callable[..., Any], chunks: list[Any], handle: Any, by_hand: bool = False, n: int = ROLLOUTS
) -> list[dict]:
    results = []
    for rollout_id in range(n):
        if by_hand and rollout_id > 0:
            rebuild_by_hand(chunks)
        results.append(run_rollout(train, rollout_id, chunks, handle))
    return results


def _main(out: str) -> None:
    from megatron_rl_patches.patching.startup import hook as bootstrap

    bootstrap.run()  # what the installed .pth does at start-up (not installed in the dev venv)

    import torch
    import wrapt
    from slime.backends.megatron_utils import model as slime_model

    import megatron_rl_patches
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    wrapped = isinstance(slime_model.train, wrapt.FunctionWrapper)
    patched, control = {}, {}
    with megatron_on_cpu() as handle:
        for num_chunks in (1, 2):
            patched[num_chunks] = run_rollouts(slime_model.train, build_chunks(handle, num_chunks), handle)
        # after the runs: the stand-in imports megatron-core (a DDP target) only when it trains
        statuses = [s.as_dict() for s in megatron_rl_patches.applied()]
        megatron_rl_patches.revert()
        for num_chunks in (1, 2):
            chunks = build_chunks(handle, num_chunks)
            control[num_chunks] = run_rollouts(slime_model.train, chunks, handle, by_hand=True)
    torch.save({"statuses": statuses, "train_wrapped": wrapped, "patched": patched, "control": control}, out)


if __name__ == "__main__":
    _main(sys.argv[1])
