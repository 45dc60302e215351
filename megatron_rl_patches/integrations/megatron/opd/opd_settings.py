"""The settings of slime's top-k multi-teacher OPD (`slime_opd`), read from the environment so
slime's own command line stays unchanged (`settings.opd_values`: the variables' text, read at slime's
door, `integrations.slime.held_settings`), parsed here once into an `OpdSettings` passed down; every
bad value is a ValueError naming the variable."""
# lazy imports: import cost: the start-up hook loads this module with MEGATRON_RL_PATCHES=all (test_lazy_import)
from __future__ import annotations

import importlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_rl_patches.ops.scoring_plan import VOCAB, FullVocabulary, ScoringPlan, TopK, checked_k
from megatron_rl_patches.settings import OPD_COEF as COEF
from megatron_rl_patches.settings import OPD_DIVERGENCE as DIVERGENCE
from megatron_rl_patches.settings import OPD_IDS_FROM as IDS_FROM
from megatron_rl_patches.settings import OPD_K as K
from megatron_rl_patches.settings import OPD_POLICY_WEIGHT as POLICY_WEIGHT
from megatron_rl_patches.settings import OPD_PREFIX as PREFIX  # noqa: F401 - the variables' common start
from megatron_rl_patches.settings import OPD_RESIDENCY as RESIDENCY
from megatron_rl_patches.settings import OPD_SCORE_AT as SCORE_AT
from megatron_rl_patches.settings import OPD_TEACHERS as TEACHERS
from megatron_rl_patches.settings import OPD_WEIGHTS as WEIGHTS
from megatron_rl_patches.settings import RESIDENCY_MODES, ascii_int, opd_values
from megatron_rl_patches.teachers.entry import SERVED
from megatron_rl_patches.teachers.entry import TeacherEntry as Teacher
from megatron_rl_patches.teachers.kinds import parse_entries
from megatron_rl_patches.teachers.kinds.options import OWN_TOKENIZER, STOP_TOKENS  # noqa: F401 - the entry's options (--help)
from megatron_rl_patches.teachers.redaction import quoted, redacted, scrubbed

IDS_SOURCES = ("student", "union", "teacher")
SCORE_PLACES = ("rollout", "train")  # where a served teacher is asked (MEGATRON_RL_PATCHES_OPD_SCORE_AT)
SCORE_DEFAULT = "train"  # measured: docs/benchmarks.md, "A served teacher off the train step"
SHOWN = 40  # characters of a setting's value its refusal quotes (a pasted megabyte must not flood stderr)
# slime's --custom-loss-function-path for top-k OPD: the documented path (users type it), and the
# loss's module path since integrations/slime/ became a package; both are accepted.
LOSS_PATH = "megatron_rl_patches.integrations.slime_opd.topk_opd_policy_loss"
LOSS_PATHS = (LOSS_PATH, "megatron_rl_patches.integrations.slime.opd.topk_opd_policy_loss")


DEFAULT_K = checked_k(16)  # MEGATRON_RL_PATCHES_OPD_K unset


@dataclass(frozen=True)
class OpdSettings:
    """What the OPD flow does: teachers, mixture weights (None: uniform), k (a `TopK`, or `VOCAB`:
    the divergence over the whole vocabulary from hidden states, `vocab_opd`), divergence, the OPD
    term's coefficient, the weight of slime's policy loss, the separate teachers' residency, and
    whose top-k ids make the buckets ("student"; "union": the student's and the first teacher's,
    2k per token with a padding mask; "teacher": the first teacher's own top-k, as
    docs/distillation.md defines them)."""

    teachers: tuple[Teacher, ...]
    weights: tuple[float, ...] | None = None
    k: TopK | FullVocabulary = DEFAULT_K
    divergence: str = "reverse_kl"
    coef: float = 1.0
    policy_weight: float = 1.0
    residency: str | None = None
    ids_from: str = "student"
    score_at: str = SCORE_DEFAULT  # "rollout": slime's rollout asks its served teachers (`rollout_teachers`)

    @property
    def full_vocab(self) -> bool:
        """K=vocab: the divergence over the whole vocabulary from hidden states (`vocab_opd`)."""
        return self.k is VOCAB

    @property
    def top_k(self) -> TopK:
        """K of the top-k route (its buckets); a ValueError at K=vocab, which has none."""
        return self.plan().k

    def plan(self, temperature: float = 1.0, invariant: bool | None = None) -> ScoringPlan:
        """The `ScoringPlan` of a step at these settings (K or the whole vocabulary) at `temperature`
        (slime's --rollout-temperature where the trainer forms the distribution; an engine's own
        rows: 1) in the student's `invariant` mode (None: the setting MEGATRON_RL_PATCHES_INVARIANT's)."""
        return ScoringPlan(self.k, temperature, invariant)


def shown(text: str) -> str:
    """A setting's value as its refusal quotes it: a URL's user and password and any piece of a live
    API key hidden, then cut to `SHOWN` characters (`quoted`)."""
    return quoted(scrubbed(redacted(text)), SHOWN)


def score_at(env: Mapping[str, str] | None = None) -> str:
    """Where the served teachers are asked: "rollout" or "train" (unset or "": `SCORE_DEFAULT`);
    ValueError naming the variable for any other value. Read by slime's rollout manager (the
    rollout asks) and checked with the other settings wherever they are (`opd_settings`, and
    `check_settings` even where the teachers are not set: the rollout manager's environment)."""
    text = (opd_values() if env is None else env).get(SCORE_AT, "")
    word = text.strip().lower() or SCORE_DEFAULT
    if word not in SCORE_PLACES:
        raise ValueError(f"{SCORE_AT}={shown(text)}: use rollout (each sample scored as its generation ends) or "
                         "train (scored by the train step), or leave it unset (train)")
    return word


def load_function(spec: str, what: str, returns: str) -> Any:
    """The function a `module:function` option names (its syntax checked with the settings); `what`
    names the option, `returns` what the function gives, in the errors."""
    module, _, name = spec.partition(":")
    try:
        function = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{TEACHERS}: {what} {spec!r} cannot be loaded ({type(exc).__name__}: {exc}); "
                         "name an importable module:function") from exc
    if not callable(function):
        raise ValueError(f"{TEACHERS}: {what} {spec!r} is a {type(function).__name__}, not a function {returns}")
    return function


def _residency(env: Mapping[str, str]) -> str | None:
    raw = env.get(RESIDENCY, "").strip().lower()
    if raw and raw not in RESIDENCY_MODES:
        raise ValueError(f"{RESIDENCY}={shown(raw)}: expected one of {list(RESIDENCY_MODES)} (the residency of the "
                         "separate teachers: PATH@module:function, Hugging Face folders of another "
                         "architecture), or unset it for resident")
    return raw or None


def _number(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name}={shown(raw)}: expected a finite number") from None
    if not math.isfinite(value):
        raise ValueError(f"{name}={shown(raw)}: expected a finite number")
    return value


FULL_VOCAB = "vocab"  # MEGATRON_RL_PATCHES_OPD_K=vocab: full-vocabulary OPD


def _k(env: Mapping[str, str]) -> TopK | FullVocabulary:
    raw = env.get(K, "").strip() or "16"
    if raw.lower() == FULL_VOCAB:
        return VOCAB  # no buckets: the divergence over the whole vocabulary
    k = ascii_int(raw) or 0
    if k <= 0:
        raise ValueError(f"{K}={shown(raw)}: expected an integer k > 0 (the student's top-k ids per token) or "
                         f"'{FULL_VOCAB}' (the divergence over the whole vocabulary)")
    return checked_k(k)  # checked once, here: the top-k processor and ops take it as it is


def full_vocab_refusal(teachers: tuple[Teacher, ...], ids_from: str) -> str | None:
    """Why MEGATRON_RL_PATCHES_OPD_K=vocab cannot serve these settings, or None: every teacher must
    give its final hidden states and an output layer over the student's vocabulary (a snapshot, a
    separate model of the student's tokenizer, a served teacher with `;head=DIR`), and no ids are
    selected (a privileged context is taken: the states come from the teacher's pass over context +
    response). The first teacher that cannot is named."""
    if ids_from != "student":
        return (f"{IDS_FROM}={ids_from}: the full vocabulary selects no ids; unset {IDS_FROM} (or use a top-k "
                f"{K}=N for {ids_from} ids)")
    for teacher in teachers:
        where = f"{TEACHERS} entry '{teacher.path}'"
        if teacher.other_tokenizer:
            return (f"{where} has another tokenizer: its vocabulary is not the student's, so its distribution "
                    f"cannot be compared id by id; use a top-k {K}=N (its buckets are grouped by shared strings)")
        if teacher.kind == SERVED and teacher.head is None:
            return (f"{where} is a served teacher without a head: the engine sends its top-k log-probs only; "
                    "serve its hidden states (vLLM --runner pooling --convert embed) and add ';head=DIR' (its "
                    f"Hugging Face directory), or use a top-k {K}=N")
        if teacher.at_layout:
            return (f"{where} ';{teacher.layout_written}': a teacher at its own layout does not hand its hidden "
                    f"states to the student's ranks yet; drop ';{teacher.layout_written}' or use a top-k {K}=N")
    return None


def _weights(env: Mapping[str, str], count: int) -> tuple[float, ...] | None:
    raw = env.get(WEIGHTS, "").strip()
    if not raw:
        return None
    try:
        weights = tuple(float(w) for w in raw.split(","))
    except ValueError:
        raise ValueError(f"{WEIGHTS}={shown(raw)}: expected comma-separated numbers, one per teacher") from None
    if len(weights) != count:
        raise ValueError(f"{WEIGHTS}={shown(raw)} gives {len(weights)} weights for {count} teachers in {TEACHERS}: "
                         "give one weight per teacher (or unset it for uniform weights)")
    if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"{WEIGHTS}={shown(raw)}: weights must be finite, >= 0, with a positive sum")
    if abs(math.fsum(weights) - 1) > 1e-6:  # the package's policy: the mixture's probabilities, never rescaled
        scaled = ",".join(f"{w / math.fsum(weights):g}" for w in weights)
        raise ValueError(f"{WEIGHTS}={shown(raw)} sums to {math.fsum(weights):g}: the weights are the teachers' "
                         f"mixture probabilities and must sum to 1 (e.g. {scaled})")
    return weights


def context_tokenizer(teacher: Teacher) -> str | None:
    """Whose tokenizer reads a teacher's privileged context: None for the student's, else the
    teacher's own (its directory with `;tokenizer=own`, the directory `;tokenizer=DIR` names)."""
    if not teacher.other_tokenizer:
        return None
    return teacher.path if teacher.tokenizer is None else teacher.tokenizer


def context_keys(settings: OpdSettings | None) -> list[str]:
    """The keys the step's teachers read their contexts under, in entry order, once each."""
    if settings is None:
        return []
    return list(dict.fromkeys(t.context for t in settings.teachers if t.context is not None))


def key_tokenizer(settings: OpdSettings, key: str) -> str | None:
    """The tokenizer a context key is read in: None for the student's, else the teachers' of
    another tokenizer reading it (one per key: `opd_settings` refuses a key read in two)."""
    return next((context_tokenizer(t) for t in settings.teachers if t.context == key), None)


def check_context_tokenizers(teachers: Sequence[Teacher]) -> None:
    """One context key is read in one tokenizer: a key shared by teachers of different tokenizers
    refused, naming them (its ids or text would be the teachers' different tokens)."""
    readers: dict[str, dict[str | None, list[str]]] = {}
    for teacher in teachers:
        if teacher.context is not None:
            readers.setdefault(teacher.context, {}).setdefault(context_tokenizer(teacher), []).append(teacher.path)
    for key, by_tokenizer in readers.items():
        if len(by_tokenizer) > 1:
            said = "; ".join(f"{paths} in {'the student' if who is None else repr(who)}'s tokenizer"
                             for who, paths in by_tokenizer.items())
            raise ValueError(f"{TEACHERS}: ';context={key}' is read by teachers of different tokenizers ({said}): "
                             f"give each tokenizer's teachers their own key (the context in that tokenizer's ids "
                             f"or text)")


def opd_settings(env: Mapping[str, str] | None = None) -> OpdSettings | None:
    """The settings from `env` (default: the environment's, `settings.opd_values`), or None when
    MEGATRON_RL_PATCHES_OPD_TEACHERS is unset (slime's flow untouched)."""
    env = opd_values() if env is None else env
    raw = env.get(TEACHERS)
    if raw is None:
        return None
    teachers = parse_entries(raw)
    if not teachers:
        raise ValueError(f"{TEACHERS}={shown(raw)} names no teacher: give comma-separated entries (PATH, "
                         "PATH@module:function or http://host:port;engine=vllm), or unset it to switch top-k OPD off")
    check_context_tokenizers(teachers)
    from megatron_rl_patches.ops._divergences import DIVERGENCES  # the table's rows (mixed_kl included)

    divergence = env.get(DIVERGENCE, "").strip() or "reverse_kl"
    if divergence not in DIVERGENCES:
        raise ValueError(f"{DIVERGENCE}={shown(divergence)}: expected one of {list(DIVERGENCES)}")
    ids_from = env.get(IDS_FROM, "").strip() or "student"
    if ids_from not in IDS_SOURCES:
        raise ValueError(f"{IDS_FROM}={shown(ids_from)}: expected one of {list(IDS_SOURCES)} (whose top-k ids "
                         "make the buckets: the student's, the student's and the first teacher's, or the first "
                         "teacher's)")
    if ids_from == "teacher" and teachers[0].other_tokenizer:
        raise ValueError(f"{IDS_FROM}=teacher with a first teacher of another tokenizer ({teachers[0].path!r}): its "
                         f"top-k ids are not the student's; name a teacher of the student's tokenizer first in "
                         f"{TEACHERS}, or use {IDS_FROM}=student")
    place = score_at(env)  # before K=vocab's refusal: a bad value is refused whatever K is
    k = _k(env)
    refusal = full_vocab_refusal(teachers, ids_from) if k is VOCAB else None
    if refusal is not None:
        raise ValueError(f"{K}={FULL_VOCAB}: {refusal}")
    return OpdSettings(teachers=teachers, weights=_weights(env, len(teachers)), k=k, divergence=divergence,
                       coef=_number(env, COEF, 1.0), policy_weight=_number(env, POLICY_WEIGHT, 1.0),
                       residency=_residency(env), ids_from=ids_from, score_at=place)
