"""Top-k OPD's teachers behind one interface, for any Megatron host (slime's `slime_opd` today): a
teacher scores one step (`OpdTeacher.score`: its pipelined passes over the rollout, run by every
pipeline stage in teacher order) and returns its outputs in one shape contract (`TeacherScores`:
framework-free, in `megatron_rl_patches.teachers`; this module's name for it stays). A snapshot of
the actor's own weights (`SnapshotTeacher`) and a separate inference-only model (`SeparateTeacher`:
a Hugging Face directory of another architecture, or `PATH@module:function`) score the step's own
ids; both run passes over any rollout handed to them (`PassTeacher`), which a teacher with another
tokenizer wraps (`cross_passes.CrossTokenizerTeacher`). What the teachers of one step share (the
host's actor as a `TeacherActor`, the rollout, the student's pass, the pass function, the host's row
cut) is a `ScoringStep`."""
from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from megatron_rl_patches.integrations.megatron.opd.opd_settings import OpdSettings
from megatron_rl_patches.integrations.megatron.opd.topk_request import (
    CROSS_KEYS,
    IDS,
    IDS_MASK,
    STEP_IDS,
    STEP_MASK,
    TEACHER_LOGPROBS,
    TEACHER_TAILS,
    VOCAB_KEYS,
    TopkRequest,
    VocabRequest,
)
from megatron_rl_patches.integrations.megatron.opd.zigzag import whole_from_zigzag, zigzag_of_whole
from megatron_rl_patches.teachers.scores import TeacherScores


class TeacherActor(Protocol):
    """The student's actor as the in-process teachers see it; its host supplies it (slime:
    `integrations.slime.actor.SlimeActor`): its args, its model chunks, and its snapshots (a
    checkpoint of its architecture kept under a tag: loaded, swapped in, read)."""

    @property
    def args(self) -> Any:
        """The host's run arguments."""

    @property
    def model(self) -> list[Any]:
        """The actor's model chunks as they are now."""

    def switch_snapshot(self, tag: str) -> list[Any]:
        """The actor's model chunks with the snapshot `tag` swapped in ("actor": its own weights)."""

    def load_snapshot(self, tag: str, path: str) -> None:
        """The checkpoint at `path` (of the actor's architecture) kept as the snapshot `tag`."""

    def snapshot_tensors(self, tag: str) -> Mapping[str, Any]:
        """The snapshot `tag`'s tensors by name ("actor": the actor's own)."""


# (args, model chunks, rollout data, request) -> per-sample top-k fields: opd's `topk_pass`
TopkPass = Callable[[Any, list, dict, TopkRequest], dict]


def teacher_requests(settings: OpdSettings) -> tuple[TopkRequest, TopkRequest]:
    """The first teacher's request and the others': all score the student's ids; (union) the first
    selects its own top-k and scores the union, which the others score with its mask; (teacher) the
    first selects and scores its own top-k, which the others score."""
    scoring = TopkRequest(ids_key=IDS, keys=(IDS,))
    if settings.ids_from == "union":
        return (TopkRequest(k=settings.top_k, ids_key=IDS, keys=(IDS,), union=True),
                TopkRequest(ids_key=IDS, mask_key=IDS_MASK, keys=(IDS, IDS_MASK)))
    if settings.ids_from == "teacher":
        return TopkRequest(k=settings.top_k), scoring
    return scoring, scoring


STEP_REQUEST = TopkRequest(ids_key=IDS, keys=(IDS, TEACHER_LOGPROBS, TEACHER_TAILS))
UNION_STEP_REQUEST = TopkRequest(ids_key=IDS, mask_key=IDS_MASK, keys=(IDS, IDS_MASK, TEACHER_LOGPROBS, TEACHER_TAILS))


def training_request(settings: OpdSettings) -> TopkRequest:
    """The request of the student's training step under top-k OPD's `settings`: the divergence over
    the whole vocabulary from the teachers' hidden states, or the student scoring the rollout's ids
    (with their padding mask for a union; with the cross keys for grouped buckets of teachers with
    another tokenizer)."""
    if settings.full_vocab:
        return VocabRequest(keys=VOCAB_KEYS, divergence=settings.divergence, weights=settings.weights)
    if any(teacher.other_tokenizer for teacher in settings.teachers):
        return TopkRequest(ids_key=STEP_IDS, mask_key=STEP_MASK, keys=(*UNION_STEP_REQUEST.keys, *CROSS_KEYS))
    return UNION_STEP_REQUEST if settings.ids_from == "union" else STEP_REQUEST


@dataclass
class ScoringStep:
    """What the teachers of one step share: the host's actor (a `TeacherActor`), the rollout data, the settings, whether
    this rank holds the last pipeline stage (the only one with buckets), the student's own top-k
    pass and `topk_pass`, the pass that runs a model over rollout data (opd's, agreed over the
    pipeline, in the step's mode). `scored_ids` counts the teachers that scored the step's ids so
    far; `invariant` is the step's invariant mode, the student's, for the teachers' own ops."""

    actor: Any
    rollout_data: dict
    settings: OpdSettings
    last: bool
    student: dict[str, list[torch.Tensor]]
    topk_pass: TopkPass
    scored_ids: int = 0
    invariant: bool | None = None  # the student's invariant mode (None: each op resolves its own)
    # whole-response values -> this context-parallel rank's rows as the host keeps per-sample fields
    # (slime: its `cp_utils`; None: megatron-core's zigzag, `zigzag.zigzag_of_whole`)
    cut_rows: Callable[[list[torch.Tensor], dict], list[torch.Tensor]] | None = None

    def cut(self, values: list[torch.Tensor], data: dict) -> list[torch.Tensor]:
        """Whole-response values as the host keeps per-sample fields of `data` on this rank."""
        if self.cut_rows is not None:
            return self.cut_rows(values, data)
        return zigzag_of_whole(values, list(data["total_lengths"]), list(data["response_lengths"]))

    def ids_request(self) -> TopkRequest:
        """The request of the next teacher that scores the step's ids: the first one's (with a
        union, its own top-k joins the student's), then the others'."""
        first, others = teacher_requests(self.settings)
        request = others if self.scored_ids else first
        self.scored_ids += 1
        return request

    @functools.cached_property
    def student_log_probs(self) -> list[torch.Tensor]:
        """The student's own log-probs of each whole response from its top-k pass (every
        context-parallel rank's rows, one collective over them: read on the last stage only)."""
        return whole_from_zigzag(self.student["log_probs"], list(self.rollout_data["total_lengths"]),
                                 list(self.rollout_data["response_lengths"]))


class OpdTeacher(ABC):
    """A teacher of slime's top-k OPD."""

    def begin(self, actor: Any, rollout_data: dict) -> None:  # noqa: B027 - most teachers start nothing early
        """Called on every rank before the student's pass of the step (a served teacher sends its
        requests here, so the engine's time overlaps the student's forward)."""

    def unscored(self) -> None:  # noqa: B027 - most teachers started nothing to end
        """Called on every rank instead of `score` when the step scores no teacher (its last stage
        has no ids): a teacher that started something in `begin` ends it here."""

    @abstractmethod
    def score(self, step: ScoringStep) -> TeacherScores | None:
        """Its passes over the step's rollout (every pipeline stage runs them); its scores on the
        last stage, None on the others."""


# (rollout data, request) -> per-sample top-k fields: one pass of a teacher over a rollout
RolloutPass = Callable[[dict, TopkRequest], dict]


class PassTeacher(OpdTeacher):
    """A teacher that runs top-k passes over any rollout handed to it: a teacher with another
    tokenizer (`cross_passes.CrossTokenizerTeacher`) wraps one and hands it its own encoding of
    the samples."""

    @abstractmethod
    def passes(self, step: ScoringStep) -> RolloutPass:
        """The step's pass function: one pass over a rollout, answering a `TopkRequest` per sample
        on the response rows (called by every pipeline stage; a snapshot is switched in once)."""


class ModelTeacher(PassTeacher):
    """A teacher of the student's tokenizer: it scores the step's ids with its model."""

    @abstractmethod
    def model_chunks(self, actor: TeacherActor) -> list[Any]:
        """The model chunks its passes run (a snapshot is switched into the actor's first)."""

    def topk_pass(self, step: ScoringStep, chunks: list[Any], rollout_data: dict,
                  request: TopkRequest) -> dict[str, list[torch.Tensor]]:
        """One pass of `chunks` (its `model_chunks`) over `rollout_data`, answering `request` per
        sample on the response rows: opd's pass (slime's forward_only, agreed over the pipeline);
        a teacher at its own layout answers with its own collective."""
        return step.topk_pass(step.actor.args, chunks, rollout_data, request)

    def passes(self, step: ScoringStep) -> RolloutPass:
        """`topk_pass` over its `model_chunks`, taken once for the step."""
        return functools.partial(self.topk_pass, step, self.model_chunks(step.actor))

    def score(self, step: ScoringStep) -> TeacherScores | None:
        """Its [R, k] scores and [R] tails of the step's ids; a first teacher that selects ids replaces
        the step's ids by them (a union's [R, 2k] with its padding mask, or its own top-k [R, k]),
        which the later teachers score."""
        request = step.ids_request()
        out = step.topk_pass(step.actor.args, self.model_chunks(step.actor), step.rollout_data, request)
        if not step.last:  # a stage before the last: its hidden states went on, it has no buckets
            return None
        if request.k is not None:
            step.rollout_data[IDS] = out["topk_ids"]
            if "ids_mask" in out:
                step.rollout_data[IDS_MASK] = out["ids_mask"]
            else:
                step.rollout_data.pop(IDS_MASK, None)
        return TeacherScores(out["topk_log_probs"], out["tail"])


class SnapshotTeacher(str, ModelTeacher):
    """A checkpoint of the actor's architecture kept by the host as a snapshot (slime: a host copy in
    the actor's TensorBackuper), swapped into the actor's own weights for its passes
    (`TeacherActor.switch_snapshot`). It is its tag (compares and hashes as the string)."""

    def model_chunks(self, actor: TeacherActor) -> list[Any]:
        return actor.switch_snapshot(str(self))


class SeparateTeacher(list, ModelTeacher):
    """A separate inference-only model: a Hugging Face directory of another architecture
    (`hf_teachers.build_hf_teacher`) or a provider's model (`PATH@module:function`). It is its list
    of model chunks (iterates, indexes and compares as the list)."""

    def model_chunks(self, actor: Any) -> list[Any]:
        return self


def model_teacher(loaded: ModelTeacher | str | list[Any]) -> ModelTeacher:
    """A teacher of the student's tokenizer as a `ModelTeacher`: one as is; the forms the actor's
    attribute held before this interface (a snapshot tag, a list of model chunks) wrapped."""
    if isinstance(loaded, ModelTeacher):
        return loaded
    return SnapshotTeacher(loaded) if isinstance(loaded, str) else SeparateTeacher(loaded)


def opd_teacher(loaded: OpdTeacher | str | list[Any]) -> OpdTeacher:
    """A loaded teacher as an `OpdTeacher` (`model_teacher` for the earlier forms)."""
    return loaded if isinstance(loaded, OpdTeacher) else model_teacher(loaded)
