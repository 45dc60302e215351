"""Shared-prefix packing for the passes of any Megatron host (slime's today): at a pass's door, whether
it runs planned (the setting, then what the model can run, agreed over every rank) and the model's
chunks prepared; per micro-batch, the plan built from its packed tokens (agreed over the
tensor-parallel group, whose ranks run each micro-batch's collectives together) and handed to the
model as its `packed_seq_params`; the pass's figures, logged once when it ends."""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

from megatron_rl_patches._log import warn_once
from megatron_rl_patches.model.chunks import modules_of
from megatron_rl_patches.model.kinds import is_language_model
from megatron_rl_patches.ops.agreement import agree
from megatron_rl_patches.settings import SHARED_PREFIX
from megatron_rl_patches.shared_prefix.model_hooks import (
    prepare_shared_prefix,
    shared_prefix_params,
)
from megatron_rl_patches.shared_prefix.plan import plan_shared_prefix
from megatron_rl_patches.shared_prefix.refusals import shared_prefix_reason

logger = logging.getLogger("megatron_rl_patches")
OFF = ("shared prefix: {what} runs each sample packed whole: {reason} (" + SHARED_PREFIX + "=0 switches the plan "
       "off for this job, without this warning)")


WHOLE = "shared prefix: {what}: a micro-batch with {reason} is packed whole (counted in the pass's figures)"


@dataclass
class PrefixPass:
    """One pass's shared-prefix packing: the stream padded to `pad_to` (the tensor-parallel size:
    sequence parallelism splits it), `group` the tensor-parallel group that agrees each plan, the
    model's vocabulary (`vocab`: a micro-batch holding an id past it is packed whole, for the model's
    own embedding to refuse as without the plan), and the pass's figures so far (summed `PlanStats`,
    and `packed_whole`: the micro-batches that took the ordinary path)."""

    what: str
    pad_to: int = 1
    group: Any = None
    vocab: int | None = None
    figures: dict[str, int] = field(default_factory=dict)

    def params(self, tokens: Any, packed_seq_params: Any, samples: int) -> Any:
        """The `packed_seq_params` of a micro-batch packed as `tokens` [1, T] by `packed_seq_params`
        (thd; its first `samples` sequences samples, the rest padding); the given params where the
        micro-batch is one a plan does not take. Decided from the micro-batch alone, so every pipeline
        stage decides alike without a word to the others (a stage that raised here would leave the next
        one waiting for its activations)."""
        reason = whole_reason(tokens, packed_seq_params, self.vocab)
        if reason is not None:
            warn_once(WHOLE.format(what=self.what, reason=reason))
            self.figures["packed_whole"] = self.figures.get("packed_whole", 0) + 1
            return packed_seq_params
        plan = plan_shared_prefix(tokens, packed_seq_params.cu_seqlens_q, samples=samples, pad_to=self.pad_to)
        physical, logical, checksum = plan.fingerprint()
        agree(self.group, "a micro-batch's shared-prefix plan", match={"physical rows": physical,
                                                                       "logical rows": logical,
                                                                       "checksum": checksum},
              where="the tensor-parallel group")
        for name, value in plan.stats.as_dict().items():
            self.figures[name] = self.figures.get(name, 0) + value
        return shared_prefix_params(plan)

    def log(self) -> None:
        """The pass's figures in one line (rank 0's logger)."""
        logical, physical = self.figures.get("logical_tokens", 0), self.figures.get("physical_tokens", 0)
        if logical:
            logger.info("shared prefix: %s computed %d tokens for %d (%.2fx), %d groups of %d samples, %d alone",
                        self.what, physical, logical, logical / max(physical, 1), self.figures.get("groups", 0),
                        self.figures.get("shared_samples", 0), self.figures.get("alone", 0))


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


def prefix_pass(what: str, model: Any, *, training: bool, enabled: bool) -> PrefixPass | None:
    """The shared-prefix packing of the pass `what` over `model` (its chunks), or None: off
    (`enabled` False), or a model it cannot run (the reason agreed over every rank first, then warned
    once; the pass runs each sample whole). Every rank calls it at the pass's door, before the pass's
    first collective."""
    if not enabled:
        return None
    reason = shared_prefix_reason(model, training=training)
    from megatron.core import parallel_state  # lazy: optional dependency megatron-core

    if reason is None and parallel_state.get_context_parallel_world_size() > 1:  # the same size on every rank
        reason = ("the host hands each context-parallel rank its share of a micro-batch, and the plan is built from "
                  "the whole one (a hand-written loop can plan it: docs/shared-prefix.md)")
    if reason is not None:
        warn_once(OFF.format(what=what, reason=reason))
        return None
    return planned_pass(what, model)


def planned_pass(what: str, model: Any) -> PrefixPass:
    """The shared-prefix packing of the pass `what` over `model` (its chunks), prepared: for a host
    that decided at its door, agreed over every rank, that the model runs a plan (`prefix_pass`)."""
    from megatron.core import parallel_state  # lazy: optional dependency megatron-core

    prepare_shared_prefix(model)
    group = parallel_state.get_tensor_model_parallel_group()
    vocab = next((int(cast(int, m.vocab_size)) for m in modules_of(model, "prefix_pass") if is_language_model(m)), None)
    return PrefixPass(what, pad_to=parallel_state.get_tensor_model_parallel_world_size(), group=group, vocab=vocab)
