"""How top-k OPD loads each kind of teacher (`teachers.kinds.KINDS`) for a Megatron host (slime's
today; the builder's name stays `SlimeBuilder`): one per kind in `BUILDERS`, keyed by the kind's
name. Every rank decides each teacher's loading first (`loading`: the decisions that read files, agreed
over the ranks, and the checks that come before anything is built), a kind checks its teachers'
loadings together (`check_loadings`), then each teacher is built from the host's actor (a
`opd_teachers.TeacherActor`; `build`) as an `OpdTeacher`.

- checkpoint (`PATH`): the snapshot loading (a checkpoint of the actor's architecture, loaded into the
  actor and kept as a snapshot: `TeacherActor.load_snapshot`) or a Hugging Face directory of another
  architecture (a separate inference-only model on the actor's split, or at its own layout
  `;tp=N;pp=M`); with `;tokenizer=own` wrapped as a teacher with another tokenizer (`cross_passes`).
- provider (`PATH@module:function`): the provider's model built inference-only.
- served (`http://host:port;engine=vllm`): `served_teacher.build_served_teacher`.

A built teacher subclasses `OpdTeacher`: its `score(step)` runs its passes through `step.topk_pass`
(every pipeline stage, in teacher order) and returns `TeacherScores` on the last stage: [R, k]
bucket log-probs and [R] tails on the student's response rows, over the step's ids or over groups
of ids (`ids`, `ids_mask`, `alive`, `log_ratio`: a teacher with another tokenizer, which
`TeacherEntry.other_tokenizer` says before the step). A teacher of the student's tokenizer
subclasses `ModelTeacher` and names only its `model_chunks(actor)`; a teacher with another tokenizer
(`cross_passes.CrossTokenizerTeacher`) wraps any `PassTeacher`. `score_teachers` is one loop over the
loaded teachers; the loss reads which teachers gave grouped buckets from the scores, never from an
entry's option."""
# lazy imports: optional dependency megatron-core (through the builders it calls)
from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_rl_patches._log import logger
from megatron_rl_patches.inference import build_inference_model
from megatron_rl_patches.integrations.megatron.opd import cross_passes, hf_teachers, hidden_teachers
from megatron_rl_patches.integrations.megatron.opd.layout_teacher import (
    build_layout_teacher,
    check_layout_teachers,
)
from megatron_rl_patches.integrations.megatron.opd.opd_settings import (
    RESIDENCY,
    TEACHERS,
    OpdSettings,
    Teacher,
    load_function,
)
from megatron_rl_patches.integrations.megatron.opd.opd_teachers import (
    ModelTeacher,
    OpdTeacher,
    SeparateTeacher,
    SnapshotTeacher,
    TeacherActor,
    model_teacher,
    opd_teacher,
)
from megatron_rl_patches.integrations.megatron.opd.privileged import PrivilegedTeacher, StudentChunksPass
from megatron_rl_patches.integrations.megatron.opd.served_teacher import build_served_teacher
from megatron_rl_patches.model.chunks import unwrap
from megatron_rl_patches.teachers.entry import CHECKPOINT, PROVIDER, SERVED
from megatron_rl_patches.teachers.kinds.student import STUDENT

# (actor, settings, teacher, student vocabulary) -> the loading its build takes
Loading = Callable[[Any, OpdSettings, Teacher, "int | str"], str]
# (actor, settings, index, teacher, student vocabulary, loading) -> the loaded teacher
Build = Callable[[Any, OpdSettings, int, Teacher, "int | str", str], OpdTeacher]


def kind_loading(actor: Any, settings: OpdSettings, teacher: Teacher, student: int | str) -> str:
    """A kind with one loading: its name."""
    return teacher.kind


@dataclass(frozen=True)
class SlimeBuilder:
    """How slime's OPD loads one kind of teacher: `loading` (on every rank, for every teacher before
    any loads), `check_loadings` (once, over every teacher's loading, before any loads; None: nothing)
    and `build`."""

    build: Build
    loading: Loading = kind_loading
    check_loadings: Callable[[OpdSettings, list[str]], None] | None = None


def separate_teacher(args: Any, teacher: Teacher, residency: str | None) -> list[Any]:
    """The model chunks of `PATH@module:function`: the provider (called with slime's args) built
    inference-only from the path, at `residency`."""
    provider = load_function(teacher.provider or "", "teacher provider", "returning a Megatron model provider")(args)
    options: dict[str, Any] = {"load_dir": teacher.path}
    if residency is not None:
        if "residency" not in inspect.signature(build_inference_model).parameters:
            raise ValueError(f"{RESIDENCY}={residency!r}: this build_inference_model takes no residency=; unset it")
        options["residency"] = residency
    return build_inference_model(provider, **options)


def check_snapshot(actor: Any, tag: str, teacher: Teacher) -> None:
    """ValueError where a snapshot's tensors do not have the actor's shapes."""
    own, other = actor.snapshot_tensors("actor"), actor.snapshot_tensors(tag)
    wrong = [name for name in own if name not in other or other[name].shape != own[name].shape]
    if wrong:
        raise ValueError(f"{TEACHERS}: teacher {teacher.path} does not have the actor's shapes ({wrong[:3]}): "
                         "a Megatron checkpoint of another architecture needs PATH@module:function (a Hugging Face "
                         "directory of another architecture is built from its config.json)")


def checkpoint_loading(actor: Any, settings: OpdSettings, teacher: Teacher, student: int | str) -> str:
    """hf_teachers.HF for a Hugging Face `PATH` of another architecture than the actor's (agreed
    by every rank, its vocabulary checked against the student's), SNAPSHOT for other `PATH`s."""
    what = f"{TEACHERS}: teacher {teacher.path!r}"
    loading, differences = hf_teachers.teacher_loading(teacher.path, actor.args, what)
    if loading == hf_teachers.HF and not teacher.at_layout:
        hf_teachers.check_allgather_cp(actor.args, what)
    if loading == hf_teachers.HF and not teacher.own_tokenizer:
        hf_teachers.check_vocab(teacher.path, student, what)
        logger.info("megatron-rl-patches: slime_opd teacher %s differs from the actor (%s): built from its "
                    "config.json as a separate inference-only model", teacher.path, "; ".join(differences))
    return loading


def check_checkpoint_loadings(settings: OpdSettings, loadings: list[str]) -> None:
    """The `;tp=N` / `;pp=N` entries against their loadings and the world (`check_layout_teachers`)."""
    check_layout_teachers(settings, list(loadings), hf_teachers.SNAPSHOT)


def hf_teacher(actor: Any, settings: OpdSettings, index: int, teacher: Teacher, student: int | str) -> ModelTeacher:
    """A Hugging Face directory of another architecture: a separate model on the actor's split, or
    (`;tp=N` / `;pp=N`) at its own layout."""
    config = getattr(unwrap(actor.model[0]), "config", None)
    if teacher.at_layout:
        return build_layout_teacher(actor.args, teacher, student, config, settings.residency)
    return SeparateTeacher(hf_teachers.build_hf_teacher(actor.args, teacher.path, settings.residency, student, config,
                                                        f"{TEACHERS}: teacher {teacher.path!r}",
                                                        own_tokenizer=teacher.own_tokenizer))


def snapshot_teacher(actor: Any, settings: OpdSettings, index: int, teacher: Teacher, student: int | str
                     ) -> ModelTeacher:
    """A checkpoint of the actor's architecture: loaded into the actor, kept as a host snapshot."""
    tag = SnapshotTeacher(f"opd_teacher_{index}")
    actor.load_snapshot(tag, teacher.path)
    check_snapshot(actor, tag, teacher)
    return tag


def build_checkpoint(actor: Any, settings: OpdSettings, index: int, teacher: Teacher, student: int | str,
                     loading: str) -> OpdTeacher:
    """The `PATH` teacher loaded its way (`loading`), wrapped when it keeps its own tokenizer."""
    build = hf_teacher if loading == hf_teachers.HF else snapshot_teacher
    model = build(actor, settings, index, teacher, student)
    return cross_passes.load_cross(actor.args, teacher, model) if teacher.own_tokenizer else model


def build_provider(actor: Any, settings: OpdSettings, index: int, teacher: Teacher, student: int | str,
                   loading: str) -> OpdTeacher:
    """`PATH@module:function`: the provider's model built inference-only, of the actor's vocabulary."""
    chunks = separate_teacher(actor.args, teacher, settings.residency)
    vocab = unwrap(actor.model[-1]).vocab_size
    teacher_vocab = unwrap(chunks[-1]).vocab_size
    if teacher_vocab != vocab:
        raise ValueError(f"{TEACHERS}: teacher {teacher.path} has vocabulary {teacher_vocab}, the actor "
                         f"{vocab}: top-k OPD compares the same token ids; use a teacher with the actor's "
                         "tokenizer")
    return SeparateTeacher(chunks)


def live_teacher(actor: Any, settings: OpdSettings, index: int, teacher: Teacher, student: int | str,
                 loading: str) -> OpdTeacher:
    """`student;context=KEY`: the actor's current weights (`privileged.StudentChunksPass`, wrapped with its
    context by `load_all`); nothing is loaded or copied."""
    return StudentChunksPass()


BUILDERS: dict[str, SlimeBuilder] = {
    CHECKPOINT: SlimeBuilder(build_checkpoint, checkpoint_loading, check_checkpoint_loadings),
    PROVIDER: SlimeBuilder(build_provider),
    SERVED: SlimeBuilder(build_served_teacher),
    STUDENT: SlimeBuilder(live_teacher),
}


def load_all(actor: Any, settings: OpdSettings, student: int | str) -> list[OpdTeacher]:
    """Every teacher of `settings` by its kind's builder: every loading decided (and each kind's
    loadings checked) before any teacher loads."""
    builders = [BUILDERS[teacher.kind] for teacher in settings.teachers]
    loadings = [builder.loading(actor, settings, teacher, student)
                for builder, teacher in zip(builders, settings.teachers)]
    for builder in dict.fromkeys(builders):
        if builder.check_loadings is not None:
            builder.check_loadings(settings, loadings)
    loaded = [builder.build(actor, settings, index, teacher, student, loading)
              for index, (builder, teacher, loading) in enumerate(zip(builders, settings.teachers, loadings))]
    # an in-process teacher with a privileged context runs its passes over context + response
    return [given_context(one, teacher) for one, teacher in zip(loaded, settings.teachers)]


def given_context(loaded: Any, teacher: Teacher) -> OpdTeacher:
    """An in-process teacher with `;context=KEY` as a `PrivilegedTeacher` (one of another tokenizer:
    its own encoding after the context; a served one sends its contexts itself); any other as
    loaded."""
    if teacher.context is None or teacher.kind == SERVED:
        return loaded
    if isinstance(loaded, cross_passes.CrossTokenizerTeacher):  # its own encoding after the context
        return dataclasses.replace(loaded, context=teacher.context)
    return PrivilegedTeacher(model_teacher(loaded), teacher.context)


def load_teachers(actor: TeacherActor, settings: OpdSettings) -> list[OpdTeacher]:
    """Every teacher of `settings` for the host's `actor` (`load_all`; the student's vocabulary
    from its Hugging Face directory, else its model's), the actor's own weights active again
    afterwards; under the full vocabulary each teacher's output layer checked against the
    student's (`hidden_teachers.check_loaded`)."""
    student = hf_teachers.student_vocab(actor.args, unwrap(actor.model[-1]).vocab_size)
    loaded = load_all(actor, settings, student)
    actor.switch_snapshot("actor")
    if settings.full_vocab:
        hidden_teachers.check_loaded(actor, [opd_teacher(teacher) for teacher in loaded])
    return loaded
