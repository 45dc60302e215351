"""A teacher layout's rank grid is megatron-core's: `groups.rank_grid` gives the groups that
megatron-core's own RankGenerator(order="tp-cp-ep-dp-pp") gives for the same sizes (tensor
parallel fastest, pipeline slowest), on every lane (0.13.1 included: the grid needs no world)."""
from __future__ import annotations

import pytest

from megatron_rl_patches.inference.teacher_layout.groups import rank_grid
from megatron_rl_patches.inference.teacher_layout.layout import TeacherLayout

pytestmark = [pytest.mark.megatron]


@pytest.mark.parametrize(("tp", "pp", "world"), [(1, 1, 4), (2, 1, 4), (1, 2, 4), (2, 2, 4), (2, 2, 8), (4, 2, 16),
                                                 (2, 4, 16), (1, 4, 8)])
def test_the_grid_is_megatron_cores_default_order(tp, pp, world):
    from megatron.core.parallel_state import RankGenerator

    dp = world // (tp * pp)
    theirs = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    grid = rank_grid(TeacherLayout(tp=tp, pp=pp), world)
    for kind, token in (("tp", "tp"), ("dp", "dp"), ("pp", "pp"), ("replica", "tp-pp")):
        assert grid[kind] == [sorted(ranks) for ranks in theirs.get_ranks(token)], kind
    assert sorted(sum(grid["stage"], [])) == list(range(world))  # the stages partition the world
    assert all(len(ranks) == world // pp for ranks in grid["stage"])


def test_a_world_the_layout_cannot_hold_is_refused_by_name():
    with pytest.raises(ValueError, match=r"cannot be laid over 6 rank\(s\): the world size must be a multiple of tp x "
                                         r"pp = 4"):
        rank_grid(TeacherLayout(tp=2, pp=2), 6)
    with pytest.raises(ValueError, match=r"TeacherLayout\(ep=2\): a teacher's own expert-parallel size is not served"):
        TeacherLayout(pp=2, ep=2)
    with pytest.raises(TypeError, match=r"TeacherLayout\(pp=\.\.\.\) must be an int"):
        TeacherLayout(pp=2.0)  # type: ignore[arg-type]
