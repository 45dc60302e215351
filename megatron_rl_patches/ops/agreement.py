"""Every "agree over the group" of the package, in one home, with one device rule.

- `agree(group, what, error=..., match=..., share=...)`: the agreement step taken before a call's
  first collective: every rank of a group tells the others whether its local checks passed, the
  values that must match and the values the call shares (shapes), in one small all-gather of a
  fixed width. A local failure anywhere, a value that differs, or ranks in different calls, is the
  same error on every rank: never a rank raising alone while the others wait in a collective, never
  values of two ranks combined silently. `local_error(check)` runs a rank's checks and keeps what
  they raised for it.
- a count's extremes (`agreed_range`, `agreed_min`, `agreed_max`), each member's tensor
  (`gathered`), a sum over the group (`summed`) and each member's picklable value
  (`gathered_objects`: a failure raised alike on every rank is built on it).
- the device rule (`group_device`): where a group's collectives take tensors, read from the
  group's backend (gloo: the host; NCCL: the current CUDA device). Every tensor this module sends
  is put there by `on_device` (the one move, which the tests record), and handed back on the
  caller's device.

A group of None, an uninitialized torch.distributed or a group of one rank exchanges nothing. Its
users: the vocabulary ops (:func:`.invariance.agreed_invariant`), the teacher-layout entry points
and their gather, the checkpoint reader, the served teacher's failure agreement and slime's step
(pipeline stages, micro-batch counts, widths, the context-parallel sum)."""
from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist

# values per rank after the header (the call's name and its error kind): a fixed width, so two
# ranks in different calls still exchange tensors of one size (and are told so, never left waiting)
SLOTS = 30
TEXT_BYTES = 400  # of each rank's message, exchanged only when a rank failed or the calls differ
# the kinds an error travels as (its first base among them; anything else: RuntimeError)
KINDS: tuple[type[Exception], ...] = (TypeError, ValueError, FileNotFoundError, OSError, RuntimeError)
Value = bool | int | float | str | None  # a str travels as its crc32; a mismatch shows the texts
T = TypeVar("T")


def local_error(check: Callable[[], T]) -> tuple[T | None, Exception | None]:
    """(check(), None), or (None, what it raised): a rank's local checks, kept to be agreed."""
    try:
        return check(), None
    except Exception as exc:  # noqa: BLE001 - any local failure is agreed, then raised on every rank
        return None, exc


def _kind(error: BaseException) -> int:
    return next((index + 1 for index, kind in enumerate(KINDS) if isinstance(error, kind)), len(KINDS))


def _number(name: str, value: Value) -> float:
    if value is None:
        return math.nan
    if isinstance(value, bool) or isinstance(value, int):
        if abs(int(value)) > 2 ** 53:
            raise ValueError(f"agree: {name}={value} does not travel exactly as a float64")
        return float(value)
    if isinstance(value, float):
        return value
    if isinstance(value, str):
        return float(zlib.crc32(value.encode("utf-8")))
    raise TypeError(f"agree: {name} must be a bool, int, float, str or None, got {type(value).__name__}")


def _shown(value: float) -> str:
    if math.isnan(value):
        return "None"
    return str(int(value)) if value.is_integer() and abs(value) < 2 ** 53 else repr(value)


def group_device(group: Any) -> torch.device:
    """Where the group's collectives take tensors: the host for gloo (also a mixed backend with
    gloo for the CPU), else the current CUDA device (NCCL)."""
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def on_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device` (itself when it is there already): the one place this module moves a
    tensor to or from a group's device."""
    return tensor.to(device)


def world() -> Any:
    """The default group when torch.distributed is initialized, else None (nothing to agree)."""
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _alone(group: Any) -> bool:
    return group is None or not dist.is_initialized() or dist.get_world_size(group) == 1


def _check_tensor(what: str, tensor: object) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: tensor must be a torch.Tensor, got {type(tensor).__name__}")


def agreed_range(group: Any, value: int) -> tuple[int, int]:
    """(min, max) of the integer `value` over the members of `group`: one all-reduce MIN of
    (value, -value) on the group's device. (value, value) with no group to agree over. TypeError
    for anything but an int (a bool counts as 0 / 1), before any exchange."""
    if not isinstance(value, int):
        raise TypeError(f"agreed_range: value must be an int (a count, a width, a 0 / 1 flag), got "
                        f"{type(value).__name__}; convert it first")
    if _alone(group):
        return int(value), int(value)
    both = on_device(torch.tensor([int(value), -int(value)], dtype=torch.int64), group_device(group))
    dist.all_reduce(both, op=dist.ReduceOp.MIN, group=group)
    low, negated_high = both.cpu().tolist()
    return int(low), -int(negated_high)


def agreed_min(group: Any, value: int) -> int:
    """The smallest `value` of the group's members (a flag held by every member: MIN of 0 / 1)."""
    return agreed_range(group, value)[0]


def agreed_max(group: Any, value: int) -> int:
    """The largest `value` of the group's members (the most micro-batches, the widest k)."""
    return agreed_range(group, value)[1]


def gathered(group: Any, tensor: torch.Tensor) -> list[torch.Tensor]:
    """Each member's `tensor` (every member passes one of the same shape and dtype), in the group's
    rank order, on `tensor`'s device: one all-gather on the group's device."""
    _check_tensor("gathered", tensor)
    if _alone(group):
        return [tensor]
    device = group_device(group)
    mine = on_device(tensor.contiguous(), device)
    every = [on_device(torch.empty_like(tensor, memory_format=torch.contiguous_format), device)
             for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return [on_device(part, tensor.device) for part in every]


def summed(group: Any, tensor: torch.Tensor) -> torch.Tensor:
    """The sum of the members' `tensor` (a new tensor on `tensor`'s device): one all-reduce SUM on
    the group's device."""
    _check_tensor("summed", tensor)
    if _alone(group):
        return tensor.clone()
    total = on_device(tensor.clone(), group_device(group))
    dist.all_reduce(total, group=group)
    return on_device(total, tensor.device)


def gathered_objects(group: Any, value: object) -> list[object]:
    """Each member's picklable `value`, in the group's rank order (torch's object all-gather, which
    applies the same device rule: the current CUDA device for NCCL, the host for gloo)."""
    if _alone(group):
        return [value]
    every: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, value, group=group)
    return every


def _texts(group: Any, size: int, text: str, device: torch.device) -> list[str]:
    """Every member's `text` (utf-8, cut to TEXT_BYTES): the second exchange, on failure only."""
    raw = text.encode("utf-8")[:TEXT_BYTES]
    mine = torch.zeros(TEXT_BYTES + 2, dtype=torch.uint8)
    mine[: 2 + len(raw)] = torch.tensor([len(raw) // 256, len(raw) % 256, *raw], dtype=torch.uint8)
    every = [on_device(torch.empty_like(mine), device) for _ in range(size)]
    dist.all_gather(every, on_device(mine, device), group=group)
    out = []
    for part in every:
        part = part.cpu()
        length = int(part[0]) * 256 + int(part[1])
        out.append(bytes(part[2: 2 + length].tolist()).decode("utf-8", errors="replace"))
    return out


def agree(group: Any, what: str, *, error: BaseException | None = None, match: Mapping[str, Value] | None = None,
          share: Mapping[str, Value] | None = None, where: str = "", device: torch.device | None = None,
          ) -> list[dict[str, float]]:
    """Every member's `share` values (by position in the group; NaN for None), once every member
    passed its checks (`error`: None, or what its checks raised), calls the same `what` and holds
    the same `match` values; else the same error on every member, naming the ranks, raised from
    the local error where there was one. `where`: the group in words (its global ranks follow).
    One all-gather of 2 + SLOTS float64s per member (a second one of each member's text only on
    failure or on a mismatch, to name them). `match` values may be text (exchanged as a crc32). A
    group of one rank (or None) exchanges nothing: `error` is raised as it is."""
    match, share = dict(match or {}), dict(share or {})
    if len(match) + len(share) > SLOTS or set(match) & set(share):
        raise ValueError(f"agree: at most {SLOTS} values, each named once, got {[*match, *share]}")
    if group is None or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return [{name: _number(name, value) for name, value in share.items()}]
    ranks = dist.get_process_group_ranks(group)
    where = f"{where or 'the group of ranks'} {ranks}"
    device = device or group_device(group)
    values = [_number(name, value) for name, value in {**match, **share}.items()]
    header = [float(zlib.crc32(what.encode("utf-8"))), float(_kind(error) if error is not None else 0)]
    mine = torch.tensor(header + values + [math.nan] * (SLOTS - len(values)), dtype=torch.float64)
    every = [on_device(torch.empty_like(mine), device) for _ in ranks]
    dist.all_gather(every, on_device(mine, device), group=group)
    table = [part.cpu().tolist() for part in every]
    failed = [i for i, row in enumerate(table) if row[1]]
    calls = {row[0] for row in table}
    if failed or len(calls) > 1:
        texts = _texts(group, len(ranks), str(error) if error is not None else what, device)
        if len(calls) > 1 and not failed:
            named = ", ".join(f"rank {ranks[i]}: {texts[i]}" for i in range(len(ranks)))
            raise RuntimeError(f"the ranks of {where} are in different calls at once ({named}): every rank of the "
                               "group must make the same call, in the same order")
        kind = KINDS[int(table[failed[0]][1]) - 1]
        distinct = list(dict.fromkeys(texts[i] for i in failed))
        if error is not None and len(failed) == len(ranks) and distinct == [texts[dist.get_rank(group)]]:
            raise error  # every rank refused alike: each raises its own, the same
        body = distinct[0] if len(distinct) == 1 else "; ".join(f"rank {ranks[i]}: {texts[i]}" for i in failed)
        raise kind(f"{body} [{what}: refused on rank(s) {[ranks[i] for i in failed]} of {where}, so on every "
                   "rank]") from error
    for slot, (name, value) in enumerate(match.items()):
        seen = [row[2 + slot] for row in table]
        if len({_shown(number) for number in seen}) > 1:
            # every member sees the same table, so every member takes this second exchange
            shown = _texts(group, len(ranks), value if isinstance(value, str) else _shown(_number(name, value)), device)
            by_rank = ", ".join(f"rank {rank}: {text}" for rank, text in zip(ranks, shown))
            raise ValueError(f"{what}: {name} differs between the ranks of {where} ({by_rank}): pass the same "
                             f"{name} on every rank")
    offset = 2 + len(match)
    return [dict(zip(share, row[offset: offset + len(share)])) for row in table]

