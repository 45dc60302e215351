"""`megatron_rl_patches.ops` lists the ops (each loaded on first use, the very function of its
module and of the package root) and keeps the documented modules `packing` and `checkpoint`."""
from __future__ import annotations

import importlib

import megatron_rl_patches
from megatron_rl_patches import ops


def test_every_listed_op_is_the_package_roots_and_its_modules():
    assert ops.__all__ == sorted(ops._LAZY)
    for name, module in ops._LAZY.items():
        value = getattr(ops, name)
        assert value is getattr(importlib.import_module(f"megatron_rl_patches.ops.{module}"), name)
        assert value is getattr(megatron_rl_patches, name), name


def test_the_documented_modules_stay_public():
    from megatron_rl_patches.ops.checkpoint import checkpointed  # noqa: F401  (docs/: ops.checkpoint)
    from megatron_rl_patches.ops.packing import PackedLayout, response_log_probs_and_entropy  # noqa: F401

    assert {"packing", "checkpoint", "kernels"} <= set(dir(ops))
