"""teacher_groups: the process groups of a TeacherLayout over the default process group's ranks,
as megatron-core's ProcessGroupCollection (megatron-core 0.15+; GPTModel(pg_collection=)),
built once per layout and world. Tensor-parallel groups are runs of consecutive ranks
({0..tp-1}, {tp..2tp-1}, ...), data-parallel groups the ranks at one tensor-parallel position;
the teacher's context, pipeline and expert dimensions are 1 (one-rank groups)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from megatron_rl_patches.inference.teacher_layout.layout import TeacherLayout

# ProcessGroupCollection fields and which of the teacher's groups each one is (those a version
# lacks are skipped): the tensor-parallel group stands for every group whose other dimensions are 1
_TP_FIELDS = ("tp", "mp", "tp_cp", "tp_ep", "tp_ep_pp", "expt_tp")
_DP_FIELDS = ("dp", "dp_cp", "expt_dp", "intra_dp_cp", "intra_expt_dp")
_ONE_FIELDS = ("cp", "pp", "ep", "embd", "pos_embd", "hcp")
_WORLD_FIELDS = ("tp_dp_cp",)


@dataclass(frozen=True)
class TeacherGroups:
    """A layout's groups on this rank: `tp_group` (the ranks that run one teacher forward
    together), `dp_group`, this rank's positions in them, and `pg_collection` (megatron-core's
    ProcessGroupCollection, handed to the teacher model)."""

    layout: TeacherLayout
    tp_group: Any
    dp_group: Any
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    pg_collection: Any

    def tp_ranks(self) -> list[int]:
        """The global ranks of this rank's teacher tensor-parallel group."""
        first = self.dp_rank * self.tp_size
        return list(range(first, first + self.tp_size))


_BUILT: dict[tuple[Any, ...], TeacherGroups] = {}


def process_group_collection_class() -> type:
    """megatron-core's ProcessGroupCollection, or ValueError naming the version that lacks it."""
    try:
        from megatron.core.process_groups_config import ProcessGroupCollection
    except ImportError:
        from megatron.core import package_info

        raise ValueError(
            f"layout=TeacherLayout(...) needs megatron-core's ProcessGroupCollection (megatron.core."
            f"process_groups_config, megatron-core >= 0.15; checked on 0.16.1 and 0.19.2) to build the teacher on its "
            f"own process groups; this is megatron-core {package_info.__version__} (its ModelCommProcessGroups is not "
            "served): upgrade megatron-core, or pass layout=None to build the teacher in the student's groups"
        ) from None
    return ProcessGroupCollection


def check_layout(layout: Any) -> tuple[TeacherLayout, int]:
    """(layout, world size) once `layout` is a TeacherLayout the running world and megatron-core
    can hold: every rank raises the same error before any collective."""
    if not isinstance(layout, TeacherLayout):
        raise TypeError(f"layout must be a TeacherLayout (e.g. TeacherLayout(tp=2)) or None, got "
                        f"{type(layout).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"layout={layout!r} needs torch.distributed initialized (the student's world): call "
                           "torch.distributed.init_process_group(...) first")
    world = dist.get_world_size()
    layout.data_parallel(world)
    process_group_collection_class()
    return layout, world


def _subgroups(enumeration: list[list[int]]) -> Any:
    group, _ = dist.new_subgroups_by_enumeration(enumeration)
    return group


def teacher_groups(layout: TeacherLayout) -> TeacherGroups:
    """This rank's TeacherGroups for `layout`, built on first use (a collective: every rank of the
    default group calls it, as build_inference_model_from_hf(layout=) does) and reused after."""
    layout, world = check_layout(layout)
    key = (layout, world, id(dist.group.WORLD))
    if key in _BUILT:
        return _BUILT[key]
    tp = layout.tp
    dp = world // tp
    tp_group = _subgroups([list(range(d * tp, (d + 1) * tp)) for d in range(dp)])
    dp_group = _subgroups([list(range(t, world, tp)) for t in range(tp)])
    one_group = _subgroups([[rank] for rank in range(world)])
    groups = {**dict.fromkeys(_TP_FIELDS, tp_group), **dict.fromkeys(_DP_FIELDS, dp_group),
              **dict.fromkeys(_ONE_FIELDS, one_group), **dict.fromkeys(_WORLD_FIELDS, dist.group.WORLD)}
    collection_class = process_group_collection_class()
    known = set(getattr(collection_class, "__dataclass_fields__", {})) or set(groups)
    collection = collection_class(**{name: group for name, group in groups.items() if name in known})
    rank = dist.get_rank()
    built = TeacherGroups(layout=layout, tp_group=tp_group, dp_group=dp_group, tp_rank=rank % tp, tp_size=tp,
                          dp_rank=rank // tp, dp_size=dp, pg_collection=collection)
    _BUILT[key] = built
    return built
