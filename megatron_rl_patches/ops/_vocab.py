"""What the vocab-parallel ops share around the statistics core (:mod:`._stats`): chunk budgets,
local columns of global ids (the row selection: :mod:`._rows`), the no-double-backward guard and :class:`OpSpec`, the
options of one call (the input checks and :class:`DeviceChecks` live in :mod:`._checks`).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rl_patches.ops._dist import tp_size, vocab_start
from megatron_rl_patches.ops._dtype import compute_dtype

# Bytes of one [rows, V_local] working buffer of the compute dtype. CPU: 4 MiB (32 rows at
# V = 32000) keeps the few-buffer working set in L3 while each chunk's small ops stay cheap next
# to its elementwise passes (AMD EPYC, AVX2, 1 thread, V = 32000, T = 4096, with the exp2 steps:
# 4 MiB 0.91-0.96x of 2 MiB's time, 3-6 MiB alike, 1 MiB 1.05-1.15x; 0.25-0.5 MiB up to 2x slower
# from per-chunk overhead, 16 MiB slower again). GPU: large chunks keep kernel launches few; the
# transient memory stays far below one copy of the logits.
CPU_CHUNK_BYTES = 4 << 20
CUDA_CHUNK_BYTES = 128 << 20



# ------------------------------------------------------------------------ dtype, chunks, scale


def default_chunk_rows(n_cols: int, device: torch.device | str, dtype: torch.dtype = torch.float32) -> int:
    """Rows per chunk so that one [rows, n_cols] buffer of `dtype` fits the per-device byte budget."""
    budget = CUDA_CHUNK_BYTES if torch.device(device).type == "cuda" else CPU_CHUNK_BYTES
    row_bytes = max(1, n_cols) * torch.empty((), dtype=dtype).element_size()
    return max(1, budget // row_bytes)


def row_chunks(n_rows: int, chunk_rows: int) -> Iterator[tuple[int, int]]:
    """(start, stop) row ranges covering ``range(n_rows)`` in steps of `chunk_rows`."""
    for start in range(0, n_rows, chunk_rows):
        yield start, min(n_rows, start + chunk_rows)


def valid_local_columns(local_vocab: int, vocab_size: int | None, group: dist.ProcessGroup | None) -> int:
    """How many of this rank's columns hold real vocab ids (Megatron pads the vocab at the end)."""
    if vocab_size is None:
        return local_vocab
    return max(0, min(local_vocab, vocab_size - vocab_start(local_vocab, group)))


def local_columns(ids: torch.Tensor, first_id: int, n_valid: int,
                  valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Local column of global `ids`, and whether this rank owns them; ids of other ranks (and
    padding) point at column `n_valid`, a sink column of the chunk buffers, so writes need no mask.
    Slots where `valid` (bool, ids' shape) is False are owned by no rank: never marked."""
    local = ids.to(torch.long) - first_id
    owned = (local >= 0) & (local < n_valid)
    if valid is not None:
        owned &= valid
    return torch.where(owned, local, n_valid), owned


# ------------------------------------------------------------------------ autograd


def reject_double_backward(backward: Callable) -> Callable:
    """Decorator for an autograd Function's backward that is not itself differentiable: with
    `create_graph=True` (grad mode on inside backward) raise instead of returning a gradient
    silently cut from the graph (what `once_differentiable` does); else run without grad."""

    def wrapped(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"{type(ctx).__name__.removesuffix('Backward')}: backward with create_graph=True (double backward, "
                "e.g. a gradient penalty) is not supported by this op; compute the penalty on a "
                "differentiable reference, or call backward without create_graph"
            )
        return backward(ctx, *grads)

    wrapped.__name__, wrapped.__doc__ = backward.__name__, backward.__doc__
    return wrapped



# ------------------------------------------------------------------------ one call's options


@dataclass(frozen=True)
class OpSpec:
    """Options of one call of a vocab-parallel op (log-probs, top-k; on logits or the fused LM
    head), fixed before its autograd Function runs."""

    group: dist.ProcessGroup | None
    first_id: int  # global id of local column 0 (of local vocab row 0 of the weight)
    n_valid: int  # local columns that are real vocab ids
    chunk_rows: int | None  # rows per chunk; the fused LM head: None = its tile budget
    op: str  # the public op and its logits argument, for messages
    arg: str = "logits"
    with_entropy: bool = False
    entropy_grad: bool = False
    inplace_backward: bool = False
    sequence_parallel: bool = False  # the fused LM head's hidden rows are sharded over the group
    invariant: bool = False  # each row's values from its own input alone (kernels.invariant_tiles)


def op_spec(
    local_vocab: int, group: dist.ProcessGroup | None, vocab_size: int | None, chunk_rows: int | None, op: str,
    **options: object,
) -> OpSpec:
    """The :class:`OpSpec` of a call on this rank's `local_vocab` columns (`vocab_size` checked)."""
    return OpSpec(group=group, first_id=vocab_start(local_vocab, group),
                  n_valid=valid_local_columns(local_vocab, vocab_size, group), chunk_rows=chunk_rows, op=op,
                  **options)  # type: ignore[arg-type]


HEAD_LOGITS = "logits (hidden @ weight.T)"  # what the fused heads' messages call the logits that never exist


def head_spec(weight: torch.Tensor, group: dist.ProcessGroup | None, sequence_parallel: bool,
              vocab_size: int | None, chunk_size: int | None, op: str, **options: object) -> OpSpec:
    """The :class:`OpSpec` of a fused-head call on the output-weight shard `weight` [V_local, H]."""
    return op_spec(weight.size(0), group, vocab_size, chunk_size, op, arg=HEAD_LOGITS,
                   sequence_parallel=bool(sequence_parallel and tp_size(group) > 1), **options)


def logits_chunk_rows(chunk_size: int | None, local_vocab: int, group: dist.ProcessGroup | None,
                      vocab_size: int | None, logits: torch.Tensor) -> int:
    """Rows per chunk of the logits ops: `chunk_size`, or the byte budget of one [rows, n_valid + 1]
    buffer of the compute dtype."""
    n_valid = valid_local_columns(local_vocab, vocab_size, group)
    return chunk_size or default_chunk_rows(n_valid + 1, logits.device, compute_dtype(logits.dtype))
