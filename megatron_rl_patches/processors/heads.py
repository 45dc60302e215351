"""Output processors for GPTModel's `output_processor=` hook: log-probs, entropy and top-k
buckets straight from the final hidden states, so the [s, b, V/tp] logits never exist.

megatron-core >= 0.18 calls the processor in place of the output layer; patch
`gpt_output_processor` gives 0.13-0.17 the same keywords. The processor reads the output weight
only after the output layer's forward pre-hooks ran (with overlap-param-gather, DDP's hook is what
waits for that weight's all-gather), takes tensor and sequence parallelism from the output layer
and folds a MuP output multiplier into the temperature.
"""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.distributed as dist

# the ops' modules, not their functions: a wrapper (or a test's spy) set on the module's function
# is what the processors call
import megatron_rl_patches.ops.kept_set as kept_set_ops
import megatron_rl_patches.ops.lm_head as lm_head_ops
import megatron_rl_patches.ops.topk as topk_ops
from megatron_rl_patches._log import warn_once
from megatron_rl_patches.ops._checks import check_scalar_temperature
from megatron_rl_patches.ops._rows import RowSelection
from megatron_rl_patches.ops.invariance import check_invariant, deferred_invariant
from megatron_rl_patches.ops.scoring_plan import checked_k, positive_int
from megatron_rl_patches.processors.output import ProcessorOutput

__all__ = ["log_prob_output_processor", "topk_output_processor"]

_LOGPROB_CONTEXT = ("keep_mask", "temperature", "row_mask", "kept_ids", "kept_positions", "kept_row_mask")
_TOPK_CONTEXT = ("ids", "ids_mask", "temperature", "row_mask")


# The output layer whose forward pre-hooks already ran for the forward under way: the backport
# for megatron-core < 0.18 calls the layer (hooks included) to capture its input.
# Not an argument: GPTModel.forward calls output_processor(hidden_states=, output_layer=, output_weight=,
# labels=, config=, context=) with megatron-core's fixed keywords, which carry no "its hooks ran".
_PRE_HOOKS_RAN: ContextVar[torch.nn.Module | None] = ContextVar("megatron_rl_patches_pre_hooks_ran", default=None)


@contextmanager
def output_layer_pre_hooks_ran(output_layer: torch.nn.Module) -> Iterator[None]:
    """Inside: `wait_for_output_weight(output_layer, ...)` runs no hook (they ran once already)."""
    token = _PRE_HOOKS_RAN.set(output_layer)
    try:
        yield
    finally:
        _PRE_HOOKS_RAN.reset(token)


def wait_for_output_weight(output_layer: torch.nn.Module, hidden_states: torch.Tensor) -> None:
    """Run the output layer's forward pre-hooks once per forward, as calling it would: with
    overlap-param-gather DDP's hook waits there for the layer's parameter all-gather (reading
    first gives stale weights)."""
    if _PRE_HOOKS_RAN.get() is output_layer:
        return
    with_kwargs = getattr(output_layer, "_forward_pre_hooks_with_kwargs", {})
    for hook_id, hook in list(output_layer._forward_pre_hooks.items()):
        if hook_id in with_kwargs:
            hook(output_layer, (hidden_states,), {})
        else:
            hook(output_layer, (hidden_states,))


def read_context(context: Any, allowed: tuple[str, ...]) -> Mapping[str, Any]:
    if context is None:
        return {}
    if not isinstance(context, Mapping):
        raise TypeError(
            f"output_processor_context must be a dict with keys among {allowed} or None, got {type(context).__name__}"
        )
    unknown = sorted(set(context) - set(allowed))
    if unknown:
        raise ValueError(f"output_processor_context has unknown keys {unknown}; accepted keys: {list(allowed)}")
    return context


def logit_multiplier(config: Any) -> float:
    """megatron-core's MuP output multiplier (logits *= mup_output_mult when use_mup), else 1."""
    if not getattr(config, "use_mup", False):
        return 1.0
    mult = getattr(config, "mup_output_mult", None)
    if not isinstance(mult, (int, float)) or not math.isfinite(mult) or mult <= 0:
        raise ValueError(
            f"config.use_mup is set but config.mup_output_mult is {mult!r}; the fused output processor "
            "folds a finite positive multiplier into the temperature: set one or disable use_mup"
        )
    return float(mult)


def check_options(temperature: object, vocab_size: object, chunk_size: object) -> None:
    """The options a processor is built with, checked as the ops check them, before any forward."""
    # float64: only the value's own range here; the op checks 1/τ against the hidden states' dtype
    check_scalar_temperature(temperature, torch.float64, "a float > 0 (per-token values go in the context)")
    if vocab_size is not None:
        positive_int("vocab_size", vocab_size, " (the real, unpadded vocabulary) or None")
    if chunk_size is not None:
        positive_int("chunk_size", chunk_size, " or None")
    hint_missing_hook()


GPT_MODULE = "megatron.core.models.gpt.gpt_model"


def hint_missing_hook() -> None:
    """One warning, when a processor is built, if the loaded GPTModel cannot take it: megatron-core
    < 0.18 without the `gpt_output_processor` patch (its forward would raise a bare TypeError on
    `output_processor=`). Looks only at a module already imported: imports nothing."""
    gpt = getattr(sys.modules.get(GPT_MODULE), "GPTModel", None)
    try:
        parameters = inspect.signature(gpt.forward).parameters if gpt is not None else None
    except (TypeError, ValueError):
        return
    if parameters is not None and "output_processor" not in parameters:
        warn_once("GPTModel.forward of this megatron-core has no output_processor keyword (added in 0.18): "
                  "apply the gpt_output_processor patch before calling the model with a processor, e.g. "
                  "megatron_rl_patches.apply(only=['gpt_output_processor']) (it is in MEGATRON_RL_PATCHES=all)")


def token_rows(value: torch.Tensor, name: str, batch: int, seq: int) -> torch.Tensor:
    """A [b, s, ...] per-token tensor as [s*b, ...] rows, in the hidden states' (s, b) order."""
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or tuple(value.shape[:2]) != (batch, seq):
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{name} must be a tensor of shape [b={batch}, s={seq}, ...] like labels, got {shape}")
    return value.transpose(0, 1).reshape(batch * seq, *value.shape[2:])


# The row selection the processor calls of one `one_row_selection()` share: [mask given, selection].
# Not an argument: each processor is called with megatron-core's output_processor keywords (above).
_SHARED_ROWS: ContextVar[list | None] = ContextVar("megatron_rl_patches_shared_rows", default=None)


@contextmanager
def one_row_selection() -> Iterator[None]:
    """Inside: processor calls given the same "row_mask" tensor share one row selection (one host
    sync and one tensor-parallel check for every op they run)."""
    token = _SHARED_ROWS.set([])
    try:
        yield
    finally:
        _SHARED_ROWS.reset(token)


def _row_mask(ctx: Mapping[str, Any], call: ProcessorCall) -> Any:
    """The selection of the context's "row_mask" [b, s] (e.g. the response tokens: masked response
    tokens still need their log-probs) over the call's rows, built once and passed as every op's
    `row_mask`: only those rows meet the output weight."""
    mask, shared = ctx.get("row_mask"), _SHARED_ROWS.get()
    if shared and shared[0] is mask:
        return shared[1]
    rows = None if mask is None else token_rows(mask, "output_processor_context['row_mask']", call.batch, call.seq)
    selection = RowSelection.of(rows, call.batch * call.seq, call.hidden.device, "hidden (all rows)", call.tp_group)
    if shared is not None:
        shared[:] = [mask, selection]
    return selection


class ProcessorCall:
    """What every processor call needs: rows of hidden states, the weight, the parallel layout."""

    def __init__(self, hidden_states, output_layer, output_weight, labels, config, temperature, context):
        if hidden_states.dim() != 3:
            raise ValueError(f"hidden_states must be [s, b, h], got shape {tuple(hidden_states.shape)}")
        self.tp_group = output_tp_group(output_layer)
        # sequence parallelism shards rows over the TP ranks: at TP = 1 (no group) there is nothing to gather
        self.sequence_parallel = bool(getattr(output_layer, "sequence_parallel", False)) and self.tp_group is not None
        local_seq, batch, _ = hidden_states.shape
        seq = local_seq * (self.tp_world if self.sequence_parallel else 1)
        self.batch, self.seq = batch, seq
        wait_for_output_weight(output_layer, hidden_states)
        self.weight = output_weight if output_weight is not None else output_layer.weight
        self.hidden = hidden_states.reshape(local_seq * batch, hidden_states.size(-1))
        self.temperature = temperature / logit_multiplier(config)
        tau = context.get("temperature")
        if tau is not None:
            # one route for per-token temperatures: the op takes τ [T] for every (global) row and
            # checks its values with the call's one host sync
            rows = token_rows(tau, "output_processor_context['temperature']", batch, seq)
            if not isinstance(rows, torch.Tensor) or not torch.is_floating_point(rows):
                raise TypeError("output_processor_context['temperature'] must be a floating tensor [b, s]")
            self.temperature = rows.detach() * self.temperature
        # a scalar τ is checked by each op the call runs (against the hidden states' dtype), not here
        self.labels = None if labels is None else token_rows(labels, "labels", batch, seq)

    @property
    def tp_world(self) -> int:
        if self.tp_group is None:
            return 1

        return dist.get_world_size(self.tp_group)

    def to_batch(self, rows: torch.Tensor) -> torch.Tensor:
        """[s*b, ...] rows back to [b, s, ...]."""
        return rows.reshape(self.seq, self.batch, *rows.shape[1:]).transpose(0, 1)


def output_tp_group(output_layer: torch.nn.Module):
    """The output layer's tensor-parallel group, or None at TP = 1 (the ops' "no TP")."""
    group = getattr(output_layer, "tp_group", None)
    if group is None:
        try:
            from megatron.core import parallel_state

            group = parallel_state.get_tensor_model_parallel_group()
        except (AssertionError, ImportError):  # parallel state not initialized: no TP
            return None
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return None
    return group


def log_prob_output_processor(
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_requires_grad: bool = True,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
    invariant: bool | None = None,
) -> Callable[..., dict[str, torch.Tensor | None]]:
    """A processor for `GPTModel.forward(..., labels=targets [b, s], output_processor=...)` that
    returns {"log_probs": [b, s], "entropy": [b, s] or None}: log p(label) and the entropy per
    token at `temperature`, from the hidden states (no logits). `output_processor_context` may be a
    dict with "row_mask" ([b, s] bool: only these tokens are computed, e.g. the response tokens;
    the others are 0 with no gradient), "keep_mask" ([b, s, V/tp] bool: ids the log-prob is normalized over) and
    "temperature" ([b, s] per-token temperatures, multiplied with `temperature`). With "kept_ids"
    ([P] ids), "kept_positions" ([P] their tokens as flat [b, s] indices, b·s_len + s) and
    "kept_row_mask" ([b, s] bool) the result also holds "kept_log_probs" [b, s]: on the masked
    tokens log p(label) renormalized over the token's kept ids and its label (top-p replay, from
    the kept ids' logits only: `ops.kept_set`), elsewhere "log_probs". `invariant`: the op's mode
    (None: the setting MEGATRON_RL_PATCHES_INVARIANT, else the model config's batch_invariant_mode)."""
    check_options(temperature, vocab_size, chunk_size)
    check_invariant(invariant)

    def process(*, hidden_states, output_layer, output_weight=None, labels=None, config=None, context=None, **_):
        ctx = read_context(context, _LOGPROB_CONTEXT)
        if labels is None:
            raise ValueError("log_prob_output_processor needs labels=[b, s] target ids in GPTModel.forward")
        call = ProcessorCall(hidden_states, output_layer, output_weight, labels, config, temperature, ctx)
        keep_mask = ctx.get("keep_mask")
        if keep_mask is not None:
            keep_mask = token_rows(keep_mask, "output_processor_context['keep_mask']", call.batch, call.seq)
        assert call.labels is not None  # checked above: labels were given
        # the call's mode for every op it runs (None: the setting, which each op agrees over its group)
        chosen = deferred_invariant(invariant, config)
        log_probs, entropy = lm_head_ops.lm_head_log_probs_and_entropy(
            call.hidden,
            call.weight,
            call.labels,
            tp_group=call.tp_group,
            sequence_parallel=call.sequence_parallel,
            temperature=call.temperature,
            with_entropy=with_entropy,
            entropy_requires_grad=entropy_requires_grad,
            keep_mask=keep_mask,
            vocab_size=vocab_size,
            chunk_size=chunk_size,
            row_mask=_row_mask(ctx, call),
            invariant=chosen,
        )
        out = ProcessorOutput(log_probs=call.to_batch(log_probs),
                              entropy=None if entropy is None else call.to_batch(entropy))
        if ctx.get("kept_ids") is not None or ctx.get("kept_row_mask") is not None:
            out["kept_log_probs"] = call.to_batch(kept_log_probs(call, ctx, log_probs, vocab_size, chosen))
        return out

    return process


def kept_log_probs(call: ProcessorCall, ctx: Mapping[str, Any], log_probs: torch.Tensor,
                   vocab_size: int | None, invariant: bool | None) -> torch.Tensor:
    """[s*b] rows: the context's kept-set log-probs on its "kept_row_mask" tokens, `log_probs` elsewhere."""
    ids, positions, mask = ctx.get("kept_ids"), ctx.get("kept_positions"), ctx.get("kept_row_mask")
    if ids is None or positions is None or mask is None:
        raise ValueError("output_processor_context needs 'kept_ids', 'kept_positions' and 'kept_row_mask' together "
                         "(the kept ids, their flat [b, s] token index, the tokens renormalized over them)")
    rows = token_rows(mask, "output_processor_context['kept_row_mask']", call.batch, call.seq)
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.bool:
        raise TypeError("output_processor_context['kept_row_mask'] must be a bool tensor [b, s]")
    if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point:
        raise TypeError("output_processor_context['kept_positions'] must be an integer tensor [P]")
    tokens = call.batch * call.seq
    outside = positions.dim() != 1 or bool(((positions < 0) | (positions >= tokens)).any())
    if outside:  # a wrapped index would renormalize another token
        raise ValueError(f"output_processor_context['kept_positions'] must be a 1-D tensor of flat [b, s] token "
                         f"indices in [0, {tokens}) (b={call.batch}, s={call.seq}), got shape {tuple(positions.shape)} "
                         f"with values {positions.min().item() if positions.numel() else None}.."
                         f"{positions.max().item() if positions.numel() else None}")
    # [b, s] flat index -> the hidden states' (s, b) row order
    kept_rows = (positions % call.seq) * call.batch + torch.div(positions, call.seq, rounding_mode="floor")
    assert call.labels is not None  # the log-prob processor requires labels
    renormalized = kept_set_ops.lm_head_kept_log_probs(call.hidden, call.weight, call.labels, ids, kept_rows,
                                          tp_group=call.tp_group, sequence_parallel=call.sequence_parallel,
                                          temperature=call.temperature, vocab_size=vocab_size, row_mask=rows,
                                          invariant=invariant)
    return torch.where(rows, renormalized, log_probs)


def topk_output_processor(
    *,
    k: int | None = None,
    union: bool = False,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
    invariant: bool | None = None,
) -> Callable[..., dict[str, torch.Tensor]]:
    """A processor returning the (k+1)-bucket top-k view of the next-token distribution:
    {"topk_ids": [b, s, k] (when it selects them), "topk_log_probs": [b, s, k], "tail": [b, s]}.
    With `k` it selects each token's top-k ids (a student); with `output_processor_context=
    {"ids": [b, s, k]}` (and "ids_mask" [b, s, k] for padded ids) it scores those ids instead
    (a teacher scoring the student's ids). With `union=True`, `k` and context ids (the
    student's), it selects its own top-k and scores the union (`union_ids`: the given ids
    first), returned as "topk_ids" and "ids_mask" [b, s, k_given + k] (docs/distillation.md).
    `invariant` as in `log_prob_output_processor`."""
    check_options(temperature, vocab_size, chunk_size)
    check_invariant(invariant)
    if k is not None:  # checked here once (or where the settings were parsed): the ops inside take it as it is
        k = checked_k(k, " (ids to select) or None (ids from the context)")
    if not isinstance(union, bool):
        raise TypeError(f"union must be True or False, got {union!r}")

    def process(*, hidden_states, output_layer, output_weight=None, labels=None, config=None, context=None, **_):
        ctx = read_context(context, _TOPK_CONTEXT)
        ids, mask = ctx.get("ids"), ctx.get("ids_mask")
        if union and (ids is None or k is None or mask is not None):
            raise ValueError(
                "topk_output_processor(union=True) needs k= (its own top-k) and output_processor_context="
                "{'ids': [b, s, k]} (the student's, unpadded: no 'ids_mask')"
            )
        if not union and (ids is None) == (k is None):
            raise ValueError(
                "topk_output_processor needs exactly one source of ids: k= (select the top-k) or "
                "output_processor_context={'ids': [b, s, k]} (score given ids); both with union=True"
            )
        call = ProcessorCall(hidden_states, output_layer, output_weight, None, config, temperature, ctx)
        options = dict(tp_group=call.tp_group, sequence_parallel=call.sequence_parallel,
                       temperature=call.temperature, vocab_size=vocab_size, chunk_size=chunk_size,
                       row_mask=_row_mask(ctx, call), invariant=deferred_invariant(invariant, config))
        result: dict[str, torch.Tensor] = ProcessorOutput()
        rows = None if ids is None else token_rows(ids, "output_processor_context['ids']", call.batch, call.seq)
        rows_mask = None if mask is None else token_rows(mask, "output_processor_context['ids_mask']", call.batch,
                                                         call.seq)
        if k is not None:
            with torch.no_grad():
                own = lm_head_ops.lm_head_topk_ids(call.hidden, call.weight, k, **options)
            if union:
                assert rows is not None  # checked above: union needs the student's ids
                rows, union_mask = topk_ops.union_ids(rows.to(own.device), own)
                result["ids_mask"] = call.to_batch(union_mask)
                rows_mask = union_mask
            else:
                rows, rows_mask = own, None
            result["topk_ids"] = call.to_batch(rows)
        assert rows is not None  # checked above: ids from k= or from the context
        log_probs, tail = lm_head_ops.lm_head_topk_logprobs(call.hidden, call.weight, rows, ids_mask=rows_mask,
                                                             **options)
        result["topk_log_probs"] = call.to_batch(log_probs)
        result["tail"] = call.to_batch(tail)
        return result

    return process
