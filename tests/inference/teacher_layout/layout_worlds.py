"""What the teacher-layout worlds share: a spawned world over a tiny Hugging Face checkpoint (the
2-rank one spawned once for the Python API's checks, slime_opd's and a role's: `two_rank_world`), the skip of
a megatron-core that refuses a teacher layout, the check that TP=2 ranks read disjoint halves of
the checkpoint (the kit's FileReads), and the fp32 tolerance against the 1-rank teacher."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from megatron_rl_patches.testing.multirank import run_multirank


def checkpoint_world(tmp_path_factory: Any, name: str, worker: Callable[..., dict], ranks: int = 2,
                     seed: int = 3, **config: Any) -> list[dict]:
    """`worker(rank, world, root)` run once on `ranks` gloo ranks over a tiny qwen3 checkpoint."""
    from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, write_tiny_checkpoint

    root = tmp_path_factory.mktemp(name) / "qwen3"
    write_tiny_checkpoint(root, tiny_hf_config("qwen3", **config), seed=seed)
    return run_multirank(worker, ranks, str(root), timeout=300 * (ranks // 2))


_TWO_RANKS: list[dict] = []  # the 2-rank world's results, once spawned (one per test session)


def _two_rank_checks(rank: int, world_size: int, root: str) -> dict:
    """Every 2-rank teacher-layout check in one world: the Python API's, slime_opd's, a role's,
    the families' (test_teacher_layout_families.py), swap / stream at a layout
    (test_teacher_layout_residency.py), then the device rule under a faked NCCL
    (test_slime_layout_teacher_nccl_device.py)."""
    from tests.inference.teacher_layout.test_teacher_layout_2rank import api_checks
    from tests.inference.teacher_layout.test_teacher_layout_families import family_checks
    from tests.inference.teacher_layout.test_teacher_layout_residency import residency_checks
    from tests.integrations.slime.test_slime_layout_teacher_nccl_device import device_checks
    from tests.integrations.slime.test_slime_opd_layout_teacher import opd_checks
    from tests.integrations.slime.test_slime_role_layout import role_checks

    return {"api": api_checks(rank, world_size, root), "opd": opd_checks(rank, world_size, root),
            "role": role_checks(rank, world_size, root), "families": family_checks(rank, world_size, root),
            "residency": residency_checks(rank, world_size, root), "device": device_checks(rank, world_size, root)}


def two_rank_world(tmp_path_factory: Any, part: str) -> list[dict]:
    """Each rank's results of `part` ("api", "opd", "role", "families", "residency" or "device") from
    the one 2-rank world (student DP=2, teacher TP=2 over a tiny qwen3 checkpoint and the families'
    beside it), spawned by the first test module that asks."""
    if not _TWO_RANKS:
        _TWO_RANKS.extend(checkpoint_world(tmp_path_factory, "teacher_layout", _two_rank_checks))
    return [result[part] for result in _TWO_RANKS]


def served(results: list[dict]) -> None:
    """Skip where the worker found the teacher layout refused ('unsupported': megatron-core 0.13)."""
    if "unsupported" in results[0]:
        pytest.skip(f"this megatron-core refuses a teacher layout: {results[0]['unsupported']}")


def read_shares(results: list[dict], what: str) -> list[float]:
    """Each of two ranks' share of the checkpoint's bytes ('reads': FileReads.read of each rank),
    checked to be about half, the two disjoint and together whole (the norms, read by both, aside)."""
    first, second = (result["reads"] for result in results)
    total = sum(flags.size for flags in first.values())
    shares = [sum(int(flags.sum()) for flags in reads.values()) / total for reads in (first, second)]
    print(f"{what}: bytes read per rank {shares} of {total}")
    assert all(0.45 < share < 0.56 for share in shares), shares  # the norms are read whole by both
    for name, mine in first.items():
        if not name.endswith("norm.weight"):
            assert not (mine & second[name]).any() and (mine | second[name]).all(), name
    return shares


def close(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest error beyond 1e-6 relative (one fp32 ulp of a log-prob): <= 1e-6 passes."""
    error = (got - want).abs() - 1e-6 * want.abs()
    return error.max().item() if error.numel() else 0.0
