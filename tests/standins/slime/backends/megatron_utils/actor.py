"""Stand-in for slime's actor module: the class and method signatures the slime_opd records wrap
(slime 624b824a); their behaviour is tested on slime's real source (the slime lane)."""
from __future__ import annotations

from .model import forward_only  # noqa: F401  (bound at import, as slime's actor does)


class MegatronTrainRayActor:
    def init(self, args, role, with_ref=False, with_opd_teacher=False):
        raise LookupError("MegatronTrainRayActor.init: run the slime lane for slime's own")

    def train_actor(self, rollout_id, rollout_data, external_data=None):
        raise LookupError("MegatronTrainRayActor.train_actor: run the slime lane for slime's own")
