"""Per-token log-prob and entropy over vocab-parallel ``[T, V_local]`` logits at the memory floor.

Between forward and backward only the input logits and a few numbers per token are kept;
backward recomputes the softmax chunk by chunk, and with ``inplace_backward=True`` writes the
gradient into the logits' own storage. With tensor parallelism the forward needs one MAX and one
SUM all-reduce of O(T) values per call and the backward none. The math is the shared statistics
core (:mod:`._stats`) through :class:`._functions.LogProbEntropy`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rl_patches.ops import _checks, _vocab
from megatron_rl_patches.ops._functions import LogProbEntropy
from megatron_rl_patches.ops._rows import RowSelection, unselected_as
from megatron_rl_patches.ops.invariance import agreed_route
from megatron_rl_patches.ops.kernels import resolve_backend

__all__ = ["log_probs_and_entropy"]

def check_logprobs_inputs(
    logits, tokens, tp_group, temperature, chunk_size, keep_mask, vocab_size, inplace_backward
) -> tuple[_checks.DeviceChecks, float | torch.Tensor]:
    """Raise TypeError/ValueError naming the argument; checks of tensor values come back deferred
    (read with the forward's one host sync). Returns them and the checked temperature."""
    _checks.check_float_tensor(logits, "logits", "[T, V_local]")
    if logits.dim() != 2:
        raise ValueError(
            f"logits must be 2-D [T, V_local], got shape {tuple(logits.shape)}; flatten batch/sequence "
            f"dims first, e.g. logits.reshape(-1, logits.size(-1))"
        )
    n_rows, local_vocab = logits.shape
    _checks.check_tokens_shape(tokens, n_rows, logits.device, f"to match logits {tuple(logits.shape)}", "logits")
    _checks.check_group(tp_group)
    if local_vocab == 0:
        raise ValueError("logits have no vocab columns (V_local = 0)")
    vocab = _checks.global_vocab(local_vocab, tp_group, vocab_size)
    checks = _checks.DeviceChecks()
    _checks.require_tokens_in_vocab(tokens, vocab, checks, tp_group)
    temperature = _checks.check_temperature(temperature, (n_rows,), logits.device, checks, logits.dtype)
    _checks.check_chunk_size(chunk_size)
    _checks.check_keep_mask(keep_mask, logits.shape, logits.device, "the logits")
    if inplace_backward:
        _checks.check_inplace_target(logits)
    return checks, temperature


def log_probs_and_entropy(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    temperature: float | torch.Tensor = 1.0,
    with_entropy: bool = False,
    entropy_requires_grad: bool = True,
    chunk_size: int | None = None,
    keep_mask: torch.Tensor | None = None,
    vocab_size: int | None = None,
    inplace_backward: bool = False,
    backend: str = "auto",
    row_mask: torch.Tensor | None = None,
    invariant: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log p(target) and entropy of softmax(logits/τ) over a vocab sharded on `tp_group`.

    logits [T, V_local] (this rank's vocab shard; `tp_group=None` = no tensor parallelism),
    tokens [T] global ids. Keeps only the logits plus ≤ 24 B/token for backward. `keep_mask`
    normalizes the log-prob over the kept ids (the target always kept); entropy stays over the
    full distribution. Columns with global id >= `vocab_size` are ignored. With
    `inplace_backward=True` the gradient is written into the logits' storage: nothing else may
    need those logits in backward (autograd raises if something does). Outputs are fp32 (fp64 for
    fp64 logits); entropy is None unless `with_entropy`. `backend`: see
    :func:`megatron_rl_patches.ops.kernels.resolve_backend`. `row_mask` [T] bool: compute only
    these rows (e.g. the response tokens; the same mask on every tensor-parallel rank): the other
    rows' log-prob and entropy are 0 and give no gradient, their targets are not read; the
    selected rows' values and gradients are those of a call without the mask, bit for bit.
    `invariant`: each row's log-prob and entropy a function of that row's logits alone, bit for
    bit — the same whatever the other rows, the tensor-parallel split or `chunk_size` (None: the
    setting ``MEGATRON_RL_PATCHES_INVARIANT``; docs/train-rollout-agreement.md).
    """
    checks, tau = check_logprobs_inputs(logits, unselected_as(tokens, row_mask), tp_group,
                                        temperature, chunk_size, keep_mask, vocab_size, inplace_backward)
    selection = RowSelection.of(row_mask, logits.size(0), logits.device, "logits", tp_group)
    local_vocab = logits.size(1)
    vocab = _checks.global_vocab(local_vocab, tp_group, vocab_size)
    invariant, chosen = agreed_route(invariant, "log_probs_and_entropy", tp_group,
                                     lambda mode: resolve_backend(backend, logits.device, logits.dtype, mode), vocab,
                                     match=_checks.collective_values(logits.size(0), vocab, tau,
                                                                     with_entropy=bool(with_entropy),
                                                                     keep_mask=keep_mask is not None))
    spec = _vocab.op_spec(
        local_vocab, tp_group, vocab_size,
        _vocab.logits_chunk_rows(chunk_size, local_vocab, tp_group, vocab_size, logits),
        "log_probs_and_entropy",
        with_entropy=bool(with_entropy),
        entropy_grad=bool(with_entropy and entropy_requires_grad),
        inplace_backward=bool(inplace_backward),
        invariant=invariant,
    )
    log_probs, entropy = LogProbEntropy.apply(selection.take(tokens), selection.take(keep_mask),
                                              selection.take_values(tau), spec, checks, chosen, selection.rows, logits)
    return log_probs, (entropy if with_entropy else None)
