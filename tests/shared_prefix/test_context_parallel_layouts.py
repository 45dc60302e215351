"""A shared-prefix plan at CP = 2 x TP = 2 with sequence parallelism, on real megatron-core over 4
gloo ranks (one world for the module): each CP rank builds the plan of the whole micro-batch and
passes its zigzag or contiguous share of the ids; log-probs, entropy, the objective and every
gradient (summed over the CP ranks, the norms' over the TP ranks) equal the same samples packed
whole at CP = 1 x TP = 2 with the same weights; ranks that cut their ids in different layouts are told
so alike. Context parallelism beside pipeline parallelism, not yet planned, is refused by name on
all four ranks alike before anything runs."""
from __future__ import annotations

import pytest

from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.multirank import run_multirank

pytestmark = [pytest.mark.megatron, pytest.mark.multirank, pytest.mark.slow]


def _pipeline_refusal() -> str | None:
    from megatron_rl_patches.shared_prefix import check_shared_prefix
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt
    from megatron_rl_patches.testing.pipeline import stage_flags, tiny_pipeline_config

    with megatron_on_cpu(pipeline_parallel=2, context_parallel=2):
        pre, post = stage_flags()
        config = tiny_pipeline_config(2, num_layers=2, variable_seq_lengths=True, context_parallel_size=2,
                                      moe_token_dispatcher_type="alltoall")  # megatron-core refuses allgather here
        model = build_packed_gpt(seq_length=512, seed=6, config=config, pre_process=pre, post_process=post,
                                 context_parallel_layout="zigzag")
        try:
            check_shared_prefix([model], training=True)
        except ValueError as exc:
            return str(exc)
    return None


def _world(rank: int, world_size: int) -> dict:
    from kit.context_parallel_prefix import context_parallel_exactness

    return {"cp2-tp2-sp": context_parallel_exactness(2, True, [("zigzag", 2), ("contiguous", 0)], mixed_layouts=True),
            "cp2-pp2": _pipeline_refusal()}


@pytest.fixture(scope="module")
def world():
    return run_multirank(_world, 4, timeout=400)


@layouts.mark("tp2", "sp")
@pytest.mark.parametrize("layout", [pytest.param("zigzag", marks=layouts.mark("cp2-zigzag")),
                                    pytest.param("contiguous", marks=layouts.mark("cp2-allgather"))])
def test_context_parallelism_with_tensor_and_sequence_parallelism_equals_the_samples_packed_whole(world, layout):
    from kit.context_parallel_prefix import assert_exact

    assert_exact([rank["cp2-tp2-sp"] for rank in world], layout)


@layouts.mark("cp2-zigzag", "pp2")
def test_context_parallelism_beside_pipeline_stages_is_refused_alike_on_every_rank(world):
    reasons = {rank["cp2-pp2"] for rank in world}
    assert len(reasons) == 1
    (reason,) = reasons
    assert reason is not None and "context parallelism beside" in reason and "context_parallel_size=2" in reason


@layouts.mark("cp2-zigzag", "cp2-allgather", "tp2", "sp")
def test_context_parallel_ranks_given_ids_cut_in_different_layouts_are_told_so_alike(world):
    """CP rank 0 passes its zigzag share, rank 1 its contiguous one (each checked against its own layout):
    a ValueError on all four ranks before the plan's first collective, never rows read wrong."""
    if not world[0]["cp2-tp2-sp"]:
        pytest.skip("megatron-core < 0.16 refuses a plan at context parallelism by name")
    for rank in world:  # each told by its own context-parallel group (two of them beside TP = 2)
        message = rank["cp2-tp2-sp"].get(("mixed", -1))
        assert message is not None and "cp_layout differs between the ranks of the context-parallel group" in message
        assert "zigzag" in message and "contiguous" in message
