"""teacher_groups: the process groups of a TeacherLayout over the default process group's ranks,
as megatron-core's ProcessGroupCollection (megatron-core 0.15+; GPTModel(pg_collection=)),
built once per layout and world. Ranks are laid out in megatron-core's default order
"tp-cp-ep-dp-pp" (context and expert sizes 1): global rank = t + tp * (d + dp * p) at tensor
position t, data-parallel position d and pipeline stage p (`rank_grid`). A teacher replica is the
tp x pp ranks of one data-parallel position; its context and expert dimensions are one-rank groups."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from megatron_rl_patches.inference.teacher_layout.layout import TeacherLayout
from megatron_rl_patches.ops import agreement

# ProcessGroupCollection fields and which of the teacher's groups each one is (those a version
# lacks are skipped); the embedding groups are None: nothing of a frozen teacher is synchronized
# between its first and last stage (a tied output layer is read from the checkpoint on the last)
_FIELDS = {"tp": "tp", "tp_cp": "tp", "tp_ep": "tp", "expt_tp": "tp", "mp": "replica", "tp_ep_pp": "replica",
           "pp": "pp", "dp": "dp", "dp_cp": "dp", "expt_dp": "dp", "intra_dp_cp": "dp", "intra_expt_dp": "dp",
           "cp": "one", "ep": "one", "hcp": "one", "tp_dp_cp": "stage"}
_NONE_FIELDS = ("embd", "pos_embd")


def rank_grid(layout: TeacherLayout, world: int) -> dict[str, list[list[int]]]:
    """Every group of `layout` over `world` ranks by kind ("tp", "dp", "pp", "replica": tp x pp
    ranks of one data-parallel position, "stage": the ranks of one pipeline stage, "one"), in the
    enumeration order of megatron-core's RankGenerator(order="tp-cp-ep-dp-pp")."""
    tp, pp = layout.tp, layout.pp
    dp = layout.data_parallel(world)

    def at(t: int, d: int, p: int) -> int:
        return t + tp * (d + dp * p)

    return {
        "tp": [[at(t, d, p) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "dp": [[at(t, d, p) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": [[at(t, d, p) for p in range(pp)] for d in range(dp) for t in range(tp)],
        "replica": [sorted(at(t, d, p) for p in range(pp) for t in range(tp)) for d in range(dp)],
        "stage": [sorted(at(t, d, p) for d in range(dp) for t in range(tp)) for p in range(pp)],
        "one": [[rank] for rank in range(world)],
    }


@dataclass(frozen=True)
class TeacherGroups:
    """A layout's groups on this rank: `tp_group` (the ranks of one pipeline stage of a replica:
    one forward of that stage together), `pp_group` (this tensor position's stages),
    `replica_group` (the tp x pp ranks that score one gathered batch), `dp_group`, this rank's
    positions and the members' global ranks, and `pg_collection` (megatron-core's
    ProcessGroupCollection, handed to the teacher model)."""

    layout: TeacherLayout
    tp_group: Any
    pp_group: Any
    replica_group: Any
    dp_group: Any
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    members: dict[str, tuple[int, ...]]  # kind -> the global ranks of this rank's group of that kind
    pg_collection: Any

    def tp_ranks(self) -> list[int]:
        """The global ranks of this rank's teacher tensor-parallel group."""
        return list(self.members["tp"])

    def pp_ranks(self) -> list[int]:
        """The global ranks of this rank's pipeline, first stage first."""
        return list(self.members["pp"])

    def replica_ranks(self) -> list[int]:
        """The global ranks of this rank's teacher replica (tp x pp ranks), ascending: the order of
        the members' micro-batches in the gathered batch."""
        return list(self.members["replica"])

    @property
    def replica_rank(self) -> int:
        """This rank's position in replica_ranks()."""
        return self.members["replica"].index(dist.get_rank())


_BUILT: dict[tuple[Any, ...], TeacherGroups] = {}


def process_group_collection_class() -> type:
    """megatron-core's ProcessGroupCollection, or ValueError naming the version that lacks it."""
    try:
        # lazy: megatron version-dependent (ProcessGroupCollection from megatron-core 0.15)
        from megatron.core.process_groups_config import ProcessGroupCollection
    except ImportError:
        from megatron.core import package_info  # lazy: optional dependency megatron-core

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


def layout_values(layout: Any) -> dict[str, int | None]:
    """The sizes of `layout` the ranks must agree on (None where it is no TeacherLayout)."""
    sizes = layout if isinstance(layout, TeacherLayout) else None
    return {f"layout's {name}": getattr(sizes, name, None) for name in ("tp", "pp", "ep")}


def teacher_groups(layout: TeacherLayout) -> TeacherGroups:
    """This rank's TeacherGroups for `layout`, built on first use and reused after. A collective
    on every call: every rank of the default group calls it with the same layout, agreed first
    (a layout the world cannot hold, or one that differs between ranks, is the same error on every
    rank); a rank's own groups without a collective: the `teacher_groups` of its built chunks."""
    if not dist.is_available() or not dist.is_initialized():
        check_layout(layout)  # raises: no group to agree over
    _, error = agreement.local_error(lambda: check_layout(layout))
    agreement.agree(dist.group.WORLD, "teacher_groups", error=error, match=layout_values(layout),
                    where="the default process group")
    return groups_of_agreed(layout)


def built_groups(layout: TeacherLayout | None = None) -> TeacherGroups | None:
    """The groups this process built for `layout` in the current world (None: for the only layout
    built in it), or None when there are none (or several and no `layout`): no collective."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 0
    found = [groups for (built, size, world_id), groups in _BUILT.items()
             if size == world and world_id == id(dist.group.WORLD) and layout in (None, built)]
    return found[0] if len(found) == 1 else None


def groups_of_agreed(layout: TeacherLayout) -> TeacherGroups:
    """teacher_groups once the ranks agreed on `layout` (build_inference_model_from_hf agrees it
    with its other arguments): built on first use (a collective of every rank), reused after."""
    layout, world = check_layout(layout)
    key = (layout, world, id(dist.group.WORLD))
    if key in _BUILT:
        return _BUILT[key]
    rank = dist.get_rank()
    grid = rank_grid(layout, world)
    groups: dict[str, Any] = {}
    members: dict[str, tuple[int, ...]] = {}
    for kind, enumeration in grid.items():
        if layout.pp == 1 and kind in ("replica", "stage"):  # the tensor-parallel group; the world
            groups[kind] = groups["tp"] if kind == "replica" else dist.group.WORLD
            members[kind] = members["tp"] if kind == "replica" else tuple(range(world))
            continue
        groups[kind], _ = dist.new_subgroups_by_enumeration(enumeration)
        members[kind] = next(tuple(ranks) for ranks in enumeration if rank in ranks)
    collection_class = process_group_collection_class()
    known = set(getattr(collection_class, "__dataclass_fields__", {})) or {*_FIELDS, *_NONE_FIELDS}
    fields = {**{name: groups[kind] for name, kind in _FIELDS.items()}, **dict.fromkeys(_NONE_FIELDS)}
    collection = collection_class(**{name: group for name, group in fields.items() if name in known})
    built = TeacherGroups(
        layout=layout, tp_group=groups["tp"], pp_group=groups["pp"], replica_group=groups["replica"],
        dp_group=groups["dp"], tp_rank=members["tp"].index(rank), tp_size=layout.tp,
        pp_rank=members["pp"].index(rank), pp_size=layout.pp, dp_rank=members["dp"].index(rank),
        dp_size=len(members["dp"]), members=members, pg_collection=collection)
    _BUILT[key] = built
    return built
