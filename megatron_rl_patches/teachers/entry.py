"""One teacher as an entry of MEGATRON_RL_PATCHES_OPD_TEACHERS writes it (`TeacherEntry`: the
record every kind's parser returns) and what a kind's checks read of the run (`RunFacts`).
Standard library only."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megatron_rl_patches.ops.scoring_plan import VOCAB
from megatron_rl_patches.settings import written_sizes

CHECKPOINT, PROVIDER, SERVED, STUDENT = "checkpoint", "provider", "served", "student"


@dataclass(frozen=True)
class TeacherEntry:
    """One teacher: `path` (a checkpoint path, or a served teacher's URL) and its `kind` (the row
    of `teachers.kinds.KINDS` whose parser read it; left empty: "provider" with a `provider`, else
    "checkpoint"). `provider`: the `module:function` returning a Megatron model provider
    (`PATH@module:function`); `own_tokenizer` (`;tokenizer=own`): a Hugging Face directory with
    another tokenizer, scored on its own encoding of each sample; `stop_tokens`
    (`;stop_tokens=module:function`): student special id -> the teacher's id or None; `tp` / `pp`
    (`;tp=N` / `;pp=N`): a Hugging Face directory at its own sizes over all ranks; `engine`
    (`;engine=vllm`): the engine serving a URL; `tokenizer` (`;tokenizer=DIR` of a URL): the served
    teacher's own tokenizer (a directory or tokenizer.json; of the live self-teacher, where its
    variable names one: the student's, which reads text contexts); `same_tokenizer` (`;same_tokenizer` of a
    URL): the user's word that the served model's tokenizer is the student's, for a server that has
    none to probe (`--skip-tokenizer-init`), with its vocabulary size named by `vocab` (`;vocab=N`) or
    read from `config` (`;config=PATH`: the teacher's config.json, or its directory); `head`
    (`;head=DIR` of a URL): the teacher's Hugging Face directory whose output layer turns the served
    final hidden states into its whole distribution on the trainer (`teachers.TeacherHead`);
    `context` (`;context=KEY`, any kind): the teacher sees a privileged context, each sample's under
    KEY in the loop's per-sample data, before the student's response (`teachers.with_context`)."""

    path: str
    provider: str | None = None
    own_tokenizer: bool = False
    stop_tokens: str | None = None
    tp: int | None = None
    pp: int | None = None
    kind: str = ""
    engine: str | None = None
    tokenizer: str | None = None
    same_tokenizer: bool = False
    vocab: int | None = None
    config: str | None = None
    head: str | None = None
    context: str | None = None

    def __post_init__(self) -> None:
        if not self.kind:
            object.__setattr__(self, "kind", PROVIDER if self.provider is not None else CHECKPOINT)

    def without_context(self) -> TeacherEntry:
        """The entry as a client is built from it where its context key has another owner (the
        caller's wrapper, or the sequences it sends): the same entry, no key."""
        return dataclasses.replace(self, context=None)

    @property
    def same_architecture(self) -> bool:
        """No provider: a checkpoint of the actor's architecture or a Hugging Face directory."""
        return self.provider is None

    @property
    def at_layout(self) -> bool:
        """Whether the entry builds the teacher at its own layout (`;tp=N` and / or `;pp=N`)."""
        return self.tp is not None or self.pp is not None

    @property
    def layout_written(self) -> str:
        """The entry's layout options as written: 'tp=2', 'pp=2' or 'tp=2;pp=2'."""
        return written_sizes(self.tp, self.pp)

    @property
    def other_tokenizer(self) -> bool:
        """Whether the teacher has another tokenizer than the student's: its scores come in buckets
        of the student's ids grouped by shared strings (`;tokenizer=own`, or a URL's
        `;tokenizer=DIR`). The live self-teacher is the student: never."""
        return self.kind != STUDENT and (self.own_tokenizer or self.tokenizer is not None)


@dataclass(frozen=True)
class RunFacts:
    """What a kind's checks read of the run: the temperature every teacher scores at (None: not
    known, as in `doctor`) and the setting it comes from as errors name it (`temperature_from`,
    e.g. slime's "--rollout-temperature"), whose top-k ids make the buckets, and k
    (MEGATRON_RL_PATCHES_OPD_K: a K, or `VOCAB` for MEGATRON_RL_PATCHES_OPD_K=vocab, `full_vocab`)."""

    temperature: float | None = None
    ids_from: str = "student"
    k: Any = 16
    temperature_from: str = "the rollout temperature"

    @property
    def full_vocab(self) -> bool:
        """MEGATRON_RL_PATCHES_OPD_K=vocab: the whole vocabulary, no K."""
        return self.k is VOCAB
