"""A teacher's output layer on the trainer (`TeacherHead`): only `lm_head.weight` (or the embedding
where config.json ties them) of a Hugging Face teacher directory, this rank's vocabulary shard at
the student's tensor-parallel layout. With it, the final hidden states a served teacher sends become
the teacher's whole distribution: the fused ops (`lm_head_log_probs_and_entropy`,
`lm_head_topk_ids`, `lm_head_topk_logprobs`, `lm_head_divergence`) project them tile by tile."""
from __future__ import annotations

import numbers
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl_patches.inference.loading.hf.architecture import read_count
from megatron_rl_patches.inference.loading.hf.checkpoint_config import CheckpointConfig, read_checkpoint_config
from megatron_rl_patches.inference.loading.hf.files import TensorEntry, safe_open_of, tensor_index
from megatron_rl_patches.inference.loading.hf.model import padded_vocab
from megatron_rl_patches.ops.agreement import agree, local_error
from megatron_rl_patches.ops.lm_head import lm_head_log_probs_and_entropy, lm_head_topk_ids, lm_head_topk_logprobs
from megatron_rl_patches.ops.scoring_plan import positive_int
from megatron_rl_patches.teachers.finite import INT64_MAX, finite, shown
from megatron_rl_patches.teachers.head.fingerprint import HeadFacts, checkpoint_fingerprint, compare_heads
from megatron_rl_patches.teachers.head.own_scores import own_scores
from megatron_rl_patches.teachers.head.transforms import head_logit_scale, projects_through_embeddings

HEAD = "lm_head.weight"
# where a tied checkpoint keeps the embedding: a causal LM's, a vision-language wrapper's text model's
EMBEDDINGS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
              "language_model.model.embed_tokens.weight")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
SAFETENSORS_FLOATS = ("F64", "F32", "F16", "BF16")
MEGATRON_DIVISOR = 128  # Megatron-LM's default make_vocab_size_divisible_by: the student's padding


@dataclass(frozen=True, eq=False)  # a tensor inside: compared by identity
class TeacherHead:
    """A teacher's output weight: `weight` [V_local, H], rows [first_id, first_id + V_local) of the
    vocabulary padded to `padded_vocab_size` (zero rows past `vocab_size`, the real rows; pass
    `vocab_size=head.vocab_size` to the ops so the padding gets no probability mass); the whole
    vocabulary on one rank without a `tp_group`."""

    weight: torch.Tensor
    vocab_size: int
    padded_vocab_size: int
    first_id: int
    tp_group: Any = None
    source: str = ""
    checkpoint_dtype: torch.dtype | None = None  # the checkpoint's own (a served model's, usually)
    logit_scale: float = 1.0  # the engine's logits multiplier, already in `weight` (teachers.head.transforms)
    fingerprint: str = ""  # of the checkpoint read (teachers.head.fingerprint); "" for a head built by hand

    def __post_init__(self) -> None:
        check_head_fields(self)

    @property
    def hidden_size(self) -> int:
        return int(self.weight.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    @property
    def nbytes(self) -> int:
        """This rank's bytes of the head."""
        return self.weight.numel() * self.weight.element_size()

    # ------------------------------------------------------------------ the teacher's distribution
    # hidden [R, H]: the teacher's final hidden states (row r predicts the token after it); every
    # rank of `tp_group` calls with the same rows (the ops combine the shards). No gradient; no
    # [R, V] tensor: the fused ops walk the vocabulary tile by tile. `invariant`: the ops' mode, a
    # teacher's plan's (None: the setting MEGATRON_RL_PATCHES_INVARIANT).

    def token_log_probs(self, hidden: torch.Tensor, tokens: torch.Tensor, temperature: float | torch.Tensor = 1.0,
                        *, invariant: bool | None = None) -> torch.Tensor:
        """[R] log-probs of `tokens` [R] under softmax(h·Wᵀ/τ) over the real vocabulary."""
        with torch.no_grad():
            values, _ = lm_head_log_probs_and_entropy(self.rows(hidden), self.weight, tokens.to(self.weight.device),
                                                      **self.options(temperature, invariant))
        return values

    def topk(self, hidden: torch.Tensor, k: int, temperature: float | torch.Tensor = 1.0, *,
             invariant: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The teacher's own top-`k` per row at `temperature`: (ids [R, k] best first, their
        log-probs [R, k], the exact tail [R]: the log of the mass outside them)."""
        h = self.rows(hidden)
        with torch.no_grad():
            ids = lm_head_topk_ids(h, self.weight, k, **self.options(temperature, invariant))
            values, tail = lm_head_topk_logprobs(h, self.weight, ids, **self.options(temperature, invariant))
        return ids, values, tail

    def own_scores(self, hidden: torch.Tensor, tokens: torch.Tensor, k: int, temperature: float = 1.0, *,
                   invariant: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`tokens`' log-probs [R], the teacher's own top-`k` ids [R, k] with their log-probs [R, k]
        and the exact tail [R] (float64 but the ids), in one top-k and one log-prob pass
        (`own_scores`: the live self-teacher's computation)."""
        return own_scores(self.rows(hidden), self.weight, tokens.to(self.weight.device), k,
                          **self.options(temperature, invariant))

    def log_probs_at(self, hidden: torch.Tensor, ids: torch.Tensor, temperature: float | torch.Tensor = 1.0,
                     ids_mask: torch.Tensor | None = None, *,
                     invariant: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's log-probs at ids the caller chose (e.g. the student's top-k) [R, k] and
        the exact tail [R] (the log of the mass outside them); `ids_mask` [R, k] as in
        `lm_head_topk_logprobs` (padded slots: -inf, their mass in the tail)."""
        with torch.no_grad():
            return lm_head_topk_logprobs(self.rows(hidden), self.weight, ids.to(self.weight.device),
                                         ids_mask=ids_mask, **self.options(temperature, invariant))

    def rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden` [R, H] in the head's dtype and on its device; ValueError naming another width."""
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            shape = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
            raise ValueError(f"TeacherHead: hidden must be [R, {self.hidden_size}] (the teacher's final hidden "
                             f"states, this head's width), got {shape}")
        return hidden.detach().to(device=self.weight.device, dtype=self.weight.dtype)

    def options(self, temperature: float | torch.Tensor, invariant: bool | None = None) -> dict[str, Any]:
        """The ops' keywords for this head: its group, its real vocabulary, `temperature`, the mode."""
        return {"tp_group": self.tp_group, "vocab_size": self.vocab_size, "temperature": temperature,
                "invariant": invariant}

    def __repr__(self) -> str:
        rows = self.weight.shape[0]
        return (f"TeacherHead({self.source!r}, rows {self.first_id}..{self.first_id + rows} of "
                f"{self.padded_vocab_size} (vocab {self.vocab_size}), hidden {self.hidden_size}, {self.dtype})")

    @classmethod
    def from_hf(cls, path: str | os.PathLike[str], tp_group: Any = None, dtype: torch.dtype | str | None = None, *,
                make_vocab_size_divisible_by: int | None = None) -> TeacherHead:
        """The output layer of the Hugging Face checkpoint directory `path` (lm_head.weight; the
        embedding where config.json ties them and stores no lm_head.weight), only this rank's rows
        read. `tp_group`: the student's tensor-parallel group (every rank of it calls this; the
        checks are agreed over it before anything is shared); the vocabulary is padded as
        Megatron-LM pads the student's, to a multiple of `make_vocab_size_divisible_by` (None:
        128) x the group's size, and cut into equal shards. Without a group, the whole [V, H]
        (padded only when `make_vocab_size_divisible_by` is given). `dtype`: the weight's dtype
        (None: the checkpoint's; float32 / bfloat16 / float16 / float64). The engine's logits
        transforms (`teachers.head.transforms`): a scale is applied (the weight read times it), a
        soft cap, a bias or a field unknown for the architecture is refused naming it. With a group,
        every rank's checkpoint is compared (config.json and a few rows of the output layer: the
        same error on every rank, naming each rank's directory, when they differ)."""
        rank, size = group_position(tp_group)
        if make_vocab_size_divisible_by is None and tp_group is not None:  # a one-rank group pads too
            make_vocab_size_divisible_by = MEGATRON_DIVISOR
        plan, error = local_error(lambda: HeadPlan.of(path, dtype, make_vocab_size_divisible_by, size, rank))
        match: dict[str, Any] = {}
        if plan is not None:
            match = {"vocab_size": plan.vocab_size, "hidden_size": plan.hidden_size, "padded": plan.padded,
                     "dtype": str(plan.dtype)}
        agree(tp_group, "TeacherHead.from_hf", error=error, match=match, where="the tensor-parallel group")
        assert plan is not None  # agree raised otherwise
        compare_heads(tp_group, "TeacherHead.from_hf", [plan.facts()], where="the tensor-parallel group")
        weight, error = local_error(plan.read)
        agree(tp_group, "TeacherHead.from_hf: reading", error=error, where="the tensor-parallel group")
        assert weight is not None
        return cls(weight, plan.vocab_size, plan.padded, plan.first, tp_group, str(plan.root), plan.own_dtype,
                   plan.scale, plan.fingerprint)


def check_head_fields(head: TeacherHead) -> None:
    """A head built by hand, checked as `from_hf` builds one: a 2-D floating weight, its rows
    within the padded vocabulary, the real vocabulary within it, each count an int a tensor
    holds (int64), a finite non-zero logit scale; TypeError / ValueError naming the field."""
    weight = head.weight
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.dtype.is_floating_point:
        shown_weight = f"a tensor of shape {tuple(weight.shape)} and dtype {weight.dtype}" \
            if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise TypeError(f"TeacherHead(weight=...) must be a 2-D floating tensor [V_local, H] (the output layer's "
                        f"rows), got {shown_weight}")
    for name, low in (("vocab_size", 1), ("padded_vocab_size", 1), ("first_id", 0)):
        value = getattr(head, name)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not low <= int(value) <= INT64_MAX:
            raise ValueError(f"TeacherHead({name}={shown(value)}) must be an int in [{low}, int64's largest]")
    if head.vocab_size > head.padded_vocab_size:
        raise ValueError(f"TeacherHead(vocab_size={head.vocab_size}) is past padded_vocab_size="
                         f"{head.padded_vocab_size}: the padded vocabulary holds the real one")
    if head.first_id + weight.shape[0] > head.padded_vocab_size:
        raise ValueError(f"TeacherHead: the weight's rows {head.first_id}..{head.first_id + weight.shape[0]} "
                         f"(first_id + its {weight.shape[0]} rows) are past padded_vocab_size={head.padded_vocab_size}")
    if not finite(head.logit_scale) or head.logit_scale == 0:
        raise ValueError(f"TeacherHead(logit_scale={shown(head.logit_scale)}) must be a finite non-zero number (the "
                         "engine's logits multiplier, already in the weight)")


def group_position(group: Any) -> tuple[int, int]:
    """(rank in `group`, its size); (0, 1) without one."""
    if group is None:
        return 0, 1
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("TeacherHead.from_hf(tp_group=...) needs torch.distributed initialized (the student's "
                         "tensor-parallel group), or tp_group=None for the whole vocabulary on this rank")
    return dist.get_rank(group), dist.get_world_size(group)


@dataclass(frozen=True)
class HeadPlan:
    """What one rank reads: tensor `entry`'s rows [first, first + rows) (zero rows past `vocab_size`)."""

    root: Path
    entry: TensorEntry
    vocab_size: int
    hidden_size: int
    padded: int
    first: int
    rows: int
    dtype: torch.dtype
    own_dtype: torch.dtype
    scale: float = 1.0  # the engine's logits multiplier (teachers.head.transforms)
    fingerprint: str = ""

    @classmethod
    def of(cls, path: Any, dtype: Any, divisible_by: int | None, size: int, rank: int,
           fingerprinted: bool = True) -> HeadPlan:
        config = read_checkpoint_config(path, "TeacherHead.from_hf(path)")
        vocab = config.vocab_size
        hidden = read_count(config.text, config.source, "hidden_size")
        index = tensor_index(config.root)
        scale = head_logit_scale(config.fields, config.text, index, config.source)
        entry = head_entry(config, index, vocab, hidden)
        wanted = head_dtype(dtype, config, entry)
        if divisible_by is not None:
            divisible_by = positive_int("TeacherHead.from_hf(make_vocab_size_divisible_by=...)", divisible_by)
        padded = padded_vocab(vocab, divisible_by or 1, size)
        rows = padded // size
        fingerprint = checkpoint_fingerprint(config.fields, entry) if fingerprinted else ""
        return cls(config.root, entry, vocab, hidden, padded, rank * rows, rows, wanted,
                   head_dtype(None, config, entry), scale, fingerprint)

    def facts(self) -> HeadFacts:
        return HeadFacts(str(self.root), self.fingerprint, self.hidden_size, self.vocab_size, self.padded,
                         str(self.dtype))

    def read(self) -> torch.Tensor:
        """This rank's rows, converted to the dtype asked (times the engine's logits scale, formed
        in float64), zero rows past the vocabulary."""
        real = max(0, min(self.first + self.rows, self.vocab_size) - self.first)
        out = torch.zeros(self.rows, self.hidden_size, dtype=self.dtype)
        if real:
            view = safe_open_of(self.entry.file).get_slice(self.entry.name)[self.first:self.first + real]
            out[:real].copy_(view if self.scale == 1.0 else view.double() * self.scale)
        return out


def head_entry(config: CheckpointConfig, index: dict[str, TensorEntry], vocab: int, hidden: int) -> TensorEntry:
    """The checkpoint's output layer: lm_head.weight where stored (also when config.json ties it,
    as transformers serves such a checkpoint), else the tied embedding; the embedding always for an
    architecture whose engine projects through it (`head_transforms.EMBEDDING_OUTPUT`: Cohere's
    drops lm_head.weight); [vocab, hidden] checked."""
    embedded = projects_through_embeddings(config.fields, config.text)
    tied = embedded or bool(config.text.get("tie_word_embeddings", False))
    if HEAD in index and not (embedded and any(name in index for name in EMBEDDINGS)):
        entry = index[HEAD]
    elif tied and any(name in index for name in EMBEDDINGS):
        entry = index[next(name for name in EMBEDDINGS if name in index)]
    else:
        wanted = HEAD if not tied else f"{HEAD} or the tied embedding ({' / '.join(EMBEDDINGS)})"
        raise ValueError(f"TeacherHead.from_hf: {config.source!r} holds no {wanted} (config.json's "
                         f"tie_word_embeddings={tied}); is it a causal language model's checkpoint?")
    if entry.shape != (vocab, hidden):
        raise ValueError(f"TeacherHead.from_hf: {config.source!r}'s {entry.name} has shape {list(entry.shape)}, but "
                         f"config.json says vocab_size={vocab} and hidden_size={hidden}: the config and the weights "
                         f"belong to different models")
    if entry.dtype not in SAFETENSORS_FLOATS:
        raise ValueError(f"TeacherHead.from_hf: {config.source!r}'s {entry.name} is {entry.dtype}; the head is read "
                         f"from a {' / '.join(SAFETENSORS_FLOATS)} checkpoint only (dequantize it first)")
    return entry


def head_dtype(dtype: Any, config: CheckpointConfig, entry: TensorEntry) -> torch.dtype:
    """`dtype` (a torch dtype or its name), else the checkpoint's (config.json's, else the tensor's)."""
    if dtype is None:
        own = config.dtype
        if isinstance(own, str) and own.removeprefix("torch.") in DTYPES:
            return DTYPES[own.removeprefix("torch.")]
        return {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[entry.dtype]
    named = DTYPES.get(dtype.removeprefix("torch.")) if isinstance(dtype, str) else dtype
    if not isinstance(named, torch.dtype) or named not in DTYPES.values():
        raise ValueError(f"TeacherHead.from_hf(dtype=...) must be torch.float32, bfloat16, float16 or float64 (or "
                         f"None: the checkpoint's own), got {dtype!r}")
    return named
