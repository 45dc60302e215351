"""TeacherLayout: a frozen teacher's own parallel sizes over the ranks of the student's world,
chosen independently of the student's (a student at TP=1 x DP=8 beside a teacher at TP=8 holds
1/8 of the teacher per rank instead of all of it)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TeacherLayout:
    """The teacher's tensor-parallel size `tp` and pipeline-parallel size `pp` (its expert-parallel
    size `ep`: 1, the only one served so far) over all ranks of the default process group; its
    data-parallel size follows from the world: world_size // (tp * pp). Ranks are ordered as
    megatron-core orders them by default ("tp-cp-ep-dp-pp": tensor parallel fastest, pipeline
    slowest): world 4, tp=2: groups {0, 1} and {2, 3}; world 4, pp=2: stages {0, 1} (first) and
    {2, 3} (last), pipelines {0, 2} and {1, 3}.

    Checked when made (positive ints; ep > 1 refused by name) and against the world where it is
    read (`teacher_groups`, `build_inference_model_from_hf(layout=)`): a world it cannot hold is
    refused on every rank before any collective or read."""

    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"TeacherLayout({name}=...) must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"TeacherLayout({name}={value}) must be >= 1")
        if self.ep > 1:
            raise ValueError(
                f"TeacherLayout(ep={self.ep}): a teacher's own expert-parallel size is not served yet (tensor and "
                "pipeline parallelism are: TeacherLayout(tp=N, pp=M)); use ep=1, or layout=None to build the "
                "teacher in the student's own process groups"
            )

    @property
    def model_parallel(self) -> int:
        """The ranks of one teacher replica: tp * pp."""
        return self.tp * self.pp

    def data_parallel(self, world_size: int) -> int:
        """The teacher's data-parallel size in a world of `world_size` ranks; ValueError naming the
        layout when the world cannot hold it."""
        if world_size % self.model_parallel:
            raise ValueError(
                f"layout={self!r} cannot be laid over {world_size} rank(s): the world size must be a multiple "
                f"of tp x pp = {self.model_parallel}; choose a tp and pp whose product divides {world_size}"
            )
        return world_size // self.model_parallel


def check_world(tp: int, world_size: int, where: str, pp: int = 1) -> None:
    """ValueError naming `where` when a teacher at `tp` x `pp` cannot be laid over `world_size` ranks
    (its sizes as a setting writes them: `settings.layout_size`)."""
    if world_size % (tp * pp):
        sizes = f"tp={tp}" if pp == 1 else f"pp={pp}" if tp == 1 else f"tp={tp};pp={pp}"
        product = "the teacher's tp" if pp == 1 else f"the teacher's tp x pp = {tp * pp}"
        raise ValueError(f"{where}: ';{sizes}' cannot be laid over {world_size} rank(s): the world size must be "
                         f"a multiple of {product}; choose sizes whose product divides {world_size}")
