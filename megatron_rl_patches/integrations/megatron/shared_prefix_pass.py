"""Shared-prefix packing for the passes of any Megatron host (slime's today): at a pass's door, whether
it runs planned (the setting, then what the model can run, agreed over every rank) and the model's
chunks prepared; per micro-batch, the plan built from its packed tokens (agreed over the
tensor-parallel group, whose ranks run each micro-batch's collectives together) and handed to the
model as its `packed_seq_params`; the pass's figures, logged once when it ends.

Under context parallelism the plan is built from the whole micro-batch, which the host hands
beside each rank's share (`ContextCut`: slime's passes, which keep every sample whole); the share
is checked to be the cut of that whole stream, the plan agreed over the tensor- and
context-parallel ranks that hold the micro-batch, and the model told how the ids were cut."""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from megatron_rl_patches import settings
from megatron_rl_patches._log import warn_once
from megatron_rl_patches.integrations.megatron.replayed_records import whole_records
from megatron_rl_patches.integrations.megatron.shared_prefix_step_pass import held_params
from megatron_rl_patches.integrations.shared_prefix_doors.decision import Reason, agreed_decision
from megatron_rl_patches.integrations.shared_prefix_doors.frameworks import MEGATRON
from megatron_rl_patches.integrations.shared_prefix_doors.table import Layout
from megatron_rl_patches.model.chunks import modules_of
from megatron_rl_patches.model.kinds import is_language_model
from megatron_rl_patches.ops.agreement import agree, agreed_min
from megatron_rl_patches.ops.context_rows import local_rows
from megatron_rl_patches.shared_prefix.context_parallel import check_logical_layout
from megatron_rl_patches.shared_prefix.model_hooks import (
    prepare_shared_prefix,
    shared_prefix_params,
)
from megatron_rl_patches.shared_prefix.plan import plan_shared_prefix
from megatron_rl_patches.shared_prefix.repeated_padding import repeated_padding_alike

logger = logging.getLogger("megatron_rl_patches")
# a host that hands each context-parallel rank its share only (the sharing plan is built from the whole micro-batch)
HOST_CUTS = Reason("the host hands each context-parallel rank its share of a micro-batch, and the sharing plan is "
                   "built from the whole one", "plan the whole micro-batch as a hand-written loop does: "
                   "docs/shared-prefix.md")


WHOLE = "shared prefix: {what}: a micro-batch with {reason} is packed whole (counted in the pass's figures)"


@dataclass(frozen=True)
class ContextCut:
    """How a host cut each micro-batch over `size` context-parallel ranks, this one `rank`: its
    `layout`'s rows ("zigzag": megatron-core's per sequence; "contiguous": slime's --allgather-cp
    slice of the stream) of the whole packed stream, whose boundaries are the micro-batch's global
    `cu_seqlens_q`."""

    size: int
    rank: int
    layout: str


@dataclass
class PrefixPass:
    """One pass's shared-prefix packing: the stream padded to `pad_to` (the tensor-parallel size:
    sequence parallelism splits it; under context parallelism 2 · cp times it, for the ranks' equal
    zigzag shares), `group` the ranks that agree each plan (tensor-parallel; with `cut`, the tensor-
    and context-parallel ranks holding the micro-batch), the model's vocabulary (`vocab`: a
    micro-batch holding an id past it is packed whole, for the model's own embedding to refuse as
    without the plan), `cut` the host's context-parallel cut (None: one rank holds each micro-batch
    whole), `repeated_padding_once` (a padding sequence of one repeated id computed on one row: for a
    model that computes each row of it alike, `repeated_padding_alike`; slime pads with id 0), and the
    pass's figures so far (summed `PlanStats`, and `packed_whole`: the micro-batches that took the
    ordinary path); `held`: the pass's micro-batches (by index) planned step by step, each with its
    step's plan (`shared_prefix_step_pass.hold_steps`; empty: each micro-batch planned on its own);
    `records`: where the host replays MoE routes, this rank's records of the next micro-batch (each
    MoE layer's [rows, topk]; None: none replayed; a str: why they cannot be read), which its plan
    then shares by (`replayed_records`)."""

    what: str
    pad_to: int = 1
    group: Any = None
    vocab: int | None = None
    figures: dict[str, int] = field(default_factory=dict)
    cut: ContextCut | None = None
    repeated_padding_once: bool = False
    held: dict[int, Any] = field(default_factory=dict)
    records: Callable[[], Any] | None = None

    def params(self, tokens: Any, packed_seq_params: Any, samples: int, whole: Any = None,
               index: int | None = None) -> Any:
        """The `packed_seq_params` of a micro-batch packed as `tokens` [1, T] by `packed_seq_params`
        (thd; its first `samples` sequences samples, the rest padding); the given params where the
        micro-batch is one a plan does not take. Decided from the micro-batch alone, so every pipeline
        stage decides alike without a word to the others (a stage that raised here would leave the next
        one waiting for its activations). Under context parallelism (`cut`) `tokens` is this rank's
        share and `whole` [T_whole] the whole micro-batch's ids (None: the host could not rebuild it);
        the plan is built from `whole` where `tokens` is its cut, else the micro-batch runs packed whole
        on every rank of the group. `index`: the micro-batch's place in the pass, whose step's plan it
        takes where the pass plans its steps together (`held`: `shared_prefix_step_pass.hold_steps`)."""
        if index is not None and index in self.held:
            return held_params(self.held[index], tokens, packed_seq_params, index)
        if self.cut is not None:
            return self.context_parallel_params(tokens, packed_seq_params, samples, whole)
        reason = whole_reason(tokens, packed_seq_params, self.vocab)
        routed = None
        if self.records is not None:  # agreed over the group: every rank packs whole or none
            routed = whole_records(self.records(), int(tokens.numel()), self.group)
        if isinstance(routed, str):
            reason = reason or routed
        if reason is not None:
            return self.packed_whole(reason, packed_seq_params)
        plan = plan_shared_prefix(tokens, packed_seq_params.cu_seqlens_q, samples=samples, pad_to=self.pad_to,
                                  repeated_padding_once=self.repeated_padding_once, routed_experts=routed)
        physical, logical, checksum = plan.fingerprint()
        agree(self.group, "a micro-batch's shared-prefix plan", match={"physical rows": physical,
                                                                       "logical rows": logical,
                                                                       "checksum": checksum},
              where="the tensor-parallel group")
        self.count(plan)
        return shared_prefix_params(plan)

    def context_parallel_params(self, tokens: Any, packed_seq_params: Any, samples: int, whole: Any) -> Any:
        """`params` under the host's context-parallel cut: the plan of `whole`, each rank's share checked
        and the outcome agreed over the group (one rank's share that is not the cut packs it whole on all)."""
        assert self.cut is not None
        reason = whole_reason(tokens, packed_seq_params, None) or cut_reason(whole, tokens, packed_seq_params,
                                                                              self.cut)
        if reason is None:
            reason = whole_reason(whole, packed_seq_params, self.vocab)
        if not agreed_min(self.group, int(reason is None)):
            return self.packed_whole(reason or "another context-parallel or tensor-parallel rank's share that is "
                                     "not its cut of the whole micro-batch", packed_seq_params)
        plan = plan_shared_prefix(whole, packed_seq_params.cu_seqlens_q, samples=samples, pad_to=self.pad_to,
                                  repeated_padding_once=self.repeated_padding_once)
        physical, logical, checksum = plan.fingerprint()
        agree(self.group, "a micro-batch's shared-prefix plan", match={"physical rows": physical,
                                                                       "logical rows": logical,
                                                                       "checksum": checksum,
                                                                       "cp_layout": self.cut.layout},
              where="the tensor- and context-parallel ranks holding the micro-batch")
        self.count(plan)
        return shared_prefix_params(plan, cp_layout=self.cut.layout)

    def packed_whole(self, reason: str, packed_seq_params: Any) -> Any:
        warn_once(WHOLE.format(what=self.what, reason=reason))
        self.figures["packed_whole"] = self.figures.get("packed_whole", 0) + 1
        return packed_seq_params

    def count(self, plan: Any) -> None:
        for name, value in plan.stats.as_dict().items():
            self.figures[name] = self.figures.get(name, 0) + value

    def log(self) -> None:
        """The pass's figures in one line (rank 0's logger), summed over its micro-batches: the tokens
        computed for those packed, the samples in groups sharing a prefix (a group counted once per
        micro-batch holding it) and the samples alone."""
        logical, physical = self.figures.get("logical_tokens", 0), self.figures.get("physical_tokens", 0)
        if logical:
            groups = self.figures.get("groups", 0)
            logger.info("shared prefix: %s computed %d tokens for %d (%.2fx fewer), %d samples in %d group%s "
                        "sharing a prefix, %d alone", self.what, physical, logical, logical / max(physical, 1),
                        self.figures.get("shared_samples", 0), groups, "" if groups == 1 else "s",
                        self.figures.get("alone", 0))


@contextlib.contextmanager
def logged(prefix: PrefixPass | None) -> Iterator[None]:
    """The pass run inside, then its figures logged (`PrefixPass.log`; None: a pass packed whole)."""
    yield
    if prefix is not None:
        prefix.log()


def whole_reason(tokens: Any, packed_seq_params: Any, vocab: int | None) -> str | None:
    """Why a micro-batch is packed whole, or None: padding between a sample's rows (its
    `cu_seqlens_q_padded`), or an id past the vocabulary or negative (the plan refuses it; packed
    whole, the model's own embedding meets it)."""
    padded = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    if padded is not None and not bool((padded.cpu() == packed_seq_params.cu_seqlens_q.cpu()).all()):
        return "padding between a sample's rows (cu_seqlens_q_padded)"
    if vocab is not None and tokens.numel() and int(tokens.max()) >= vocab:
        return f"an id past the vocabulary ({int(tokens.max())} >= {vocab})"
    if tokens.numel() and int(tokens.min()) < 0:
        return f"a negative id ({int(tokens.min())})"
    return None


def cut_reason(whole: Any, tokens: Any, packed_seq_params: Any, cut: ContextCut) -> str | None:
    """Why this rank's `tokens` [1, T] are not `cut`'s share of the whole micro-batch `whole` [T_whole]
    (cut at the global `packed_seq_params.cu_seqlens_q`), or None."""
    if whole is None:
        return "no whole micro-batch from the host to plan (each context-parallel rank holds its share only)"
    cu = packed_seq_params.cu_seqlens_q.cpu()
    if whole.dim() != 1 or whole.numel() != int(cu[-1]):
        return (f"a whole micro-batch of shape {tuple(whole.shape)} where cu_seqlens_q spans {int(cu[-1])} "
                "rows")
    try:
        rows = local_rows(cut.layout, cut.rank, cut.size, cu_seqlens=cu)
    except ValueError as exc:
        return f"a stream the {cut.layout} layout cannot cut over {cut.size} context-parallel ranks ({exc})"
    local = tokens.reshape(-1).cpu()
    if rows.numel() != local.numel() or not torch.equal(whole.cpu()[rows].to(local.dtype), local):
        return (f"context-parallel rank {cut.rank}'s ids that are not its {cut.layout} cut of the whole "
                "micro-batch rebuilt from the samples")
    return None


def prefix_pass(what: str, model: Any, *, training: bool, enabled: bool, cut_layout: str | None = None,
                framework: str = MEGATRON, layout: Layout | None = None, extra: tuple[Reason, ...] = (),
                strict: bool | None = None) -> PrefixPass | None:
    """The shared-prefix packing of the pass `what` over `model` (its chunks), or None: off
    (`enabled` False), or a pass that packs each sample whole (`agreed_decision`: the door's reasons of
    `framework` at `layout` and `extra`, and the model's own, agreed over every rank, then one warning
    in the framework's words; a ValueError on every rank under MEGATRON_RL_PATCHES_STRICT=1, `strict`
    None: read here). Every rank calls it at the pass's door, before the pass's first collective.
    `cut_layout`: how the host cuts each micro-batch over context-parallel ranks ("zigzag" /
    "contiguous") where it hands the whole micro-batch beside each rank's share (slime, NeMo-RL) or
    rebuilds it (verl); None: a host that hands each rank its share only, which runs whole under
    context parallelism."""
    if not enabled:
        return None
    from megatron.core import parallel_state  # lazy: optional dependency megatron-core

    if cut_layout is None and parallel_state.get_context_parallel_world_size() > 1:
        extra = (*extra, HOST_CUTS)
    if not agreed_decision(framework, what, model, training=training, layout=layout or Layout(), extra=extra,
                           strict=settings.strict() if strict is None else strict):
        return None
    return planned_pass(what, model, cut_layout)


def planned_pass(what: str, model: Any, cut_layout: str | None = None) -> PrefixPass:
    """The shared-prefix packing of the pass `what` over `model` (its chunks), prepared: for a host
    that decided at its door, agreed over every rank, that the model runs a plan (`prefix_pass`;
    `cut_layout` as there)."""
    from megatron.core import parallel_state  # lazy: optional dependency megatron-core

    prepare_shared_prefix(model)
    once = repeated_padding_alike(model)  # agreed over every rank: every stage lays the padding out alike
    vocab = next((int(cast(int, m.vocab_size)) for m in modules_of(model, "prefix_pass") if is_language_model(m)), None)
    tensor = parallel_state.get_tensor_model_parallel_world_size()
    context = parallel_state.get_context_parallel_world_size()
    if cut_layout is None or context == 1:
        return PrefixPass(what, pad_to=tensor, group=parallel_state.get_tensor_model_parallel_group(), vocab=vocab,
                          repeated_padding_once=once)
    cut = ContextCut(context, parallel_state.get_context_parallel_rank(), check_logical_layout(cut_layout))
    return PrefixPass(what, pad_to=2 * context * tensor, group=parallel_state.get_tensor_and_context_parallel_group(),
                      vocab=vocab, cut=cut, repeated_padding_once=once)
