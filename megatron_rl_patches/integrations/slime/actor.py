"""slime's actor as the in-process teachers see it (`integrations.megatron.opd.opd_teachers
.TeacherActor`): its args and model chunks, its snapshots in its TensorBackuper (slime's
`load_other_checkpoint`, `_switch_model`, `weights_backuper`)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class SlimeActor:
    """A `TeacherActor` over slime's `MegatronTrainRayActor` (`actor`)."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    @property
    def args(self) -> Any:
        return self.actor.args

    @property
    def model(self) -> list[Any]:  # read when asked: a switch may hand the actor other chunks
        return self.actor.model

    def student_chunks(self) -> list[Any]:
        """The actor's own model chunks with its current weights (switched back only if a snapshot is in)."""
        if getattr(self.actor, "_active_model_tag", "actor") != "actor":
            self.actor._switch_model("actor")
        return self.actor.model

    def switch_snapshot(self, tag: str) -> list[Any]:
        self.actor._switch_model(tag)
        return self.actor.model

    def load_snapshot(self, tag: str, path: str) -> None:
        self.actor.load_other_checkpoint(tag, path)

    def snapshot_tensors(self, tag: str) -> Mapping[str, Any]:
        return self.actor.weights_backuper.get(tag)
