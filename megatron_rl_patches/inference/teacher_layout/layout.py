"""TeacherLayout: a frozen teacher's own parallel sizes over the ranks of the student's world,
chosen independently of the student's (a student at TP=1 x DP=8 beside a teacher at TP=8 holds
1/8 of the teacher per rank instead of all of it)."""
from __future__ import annotations

from dataclasses import dataclass

# the sizes a layout can name; pipeline and expert parallelism of a teacher are not served yet
_LATER = ("pp", "ep")


@dataclass(frozen=True)
class TeacherLayout:
    """The teacher's tensor-parallel size `tp` (pipeline `pp` and expert `ep` sizes: 1, the only
    ones served so far) over all ranks of the default process group; its data-parallel size
    follows from the world: world_size // tp (world 4, tp=2: two teacher groups of 2 ranks,
    ranks {0, 1} and {2, 3}, as megatron-core orders tensor-parallel ranks).

    Checked when made (positive ints; pp / ep > 1 refused by name) and against the world where it
    is read (`teacher_groups`, `build_inference_model_from_hf(layout=)`): a world it cannot hold
    is refused on every rank before any collective or read."""

    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", *_LATER):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"TeacherLayout({name}=...) must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"TeacherLayout({name}={value}) must be >= 1")
        for name in _LATER:
            if getattr(self, name) > 1:
                raise ValueError(
                    f"TeacherLayout({name}={getattr(self, name)}): a teacher's own "
                    f"{'pipeline' if name == 'pp' else 'expert'}-parallel size is not served yet (tensor "
                    f"parallelism is: TeacherLayout(tp=N)); use {name}=1, or layout=None to build the teacher "
                    "in the student's own process groups"
                )

    def data_parallel(self, world_size: int) -> int:
        """The teacher's data-parallel size in a world of `world_size` ranks; ValueError naming the
        layout when the world cannot hold it."""
        if world_size % self.tp:
            raise ValueError(
                f"layout={self!r} cannot be laid over {world_size} rank(s): the world size must be a multiple "
                f"of tp={self.tp}; choose a tp that divides {world_size}"
            )
        return world_size // self.tp
