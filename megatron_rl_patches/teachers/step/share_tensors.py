"""A step's served results, moved from the asking rank to its sharing group as tensors
(`shared_results`): never pickled.

Three steps, all on the group's device (`ops.agreement.group_device`: the host for gloo, the
current CUDA device for NCCL):

1. one int64 all-gather of two words per rank: the asking rank's layout length, and each other
   rank's word on its own arguments (results passed where None is due): every rank's mistake is
   known to every rank before anything else moves; then the layout (int64s, broadcast from the
   group's first rank): per teacher its index and kind (a `BatchScores`, or a list of per-sample
   tensors such as a head's hidden states), per field whether it is there, per sample its dtype
   code, device, rank and shape; or, when the asking rank cannot pack its results (anything wrong
   with them: no dict, a teacher index that is no int64, a tensor that cannot travel), an error
   code and its message, raised alike on every rank;
2. one flat buffer per dtype present (every tensor of that dtype, flattened end to end), filled in
   place on the asking rank and broadcast; a dtype a backend refuses (gloo and NCCL: int16; fp8,
   bool) travels as its bytes (`wire`);
3. on the other ranks each tensor a view of its dtype's buffer, placed where the asking rank held
   it (on the host, or on the current CUDA device).

The asking rank keeps its own objects; the others get values bit-identical to them, of the same
types (list or tuple, dtype, shape)."""
from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl_patches.ops.agreement import gathered, group_device, on_device
from megatron_rl_patches.teachers.contract import BatchScores

# the dtypes that travel, by code (a code is a position here, the same on every rank)
DTYPES: tuple[torch.dtype, ...] = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
                                   torch.float8_e4m3fn, torch.float8_e5m2)
# the dtypes gloo and NCCL broadcast as themselves; any other travels as its bytes (uint8)
NATIVE: tuple[torch.dtype, ...] = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int32, torch.int8, torch.uint8)
INT64_END = 2 ** 63
SCORES, ROWS = 0, 1  # a teacher's result: BatchScores, or a list / tuple of per-sample tensors
LIST, TUPLE, ABSENT = 0, 1, 2  # a field's container (ABSENT: a BatchScores field of None)
HOST, CUDA = 0, 1  # where a tensor is held
ERROR = -1  # the layout's first value when the asking rank could not pack its results
ERROR_KINDS: tuple[type[Exception], ...] = (TypeError, ValueError, RuntimeError)
FIELDS = tuple(field.name for field in dataclasses.fields(BatchScores))


class Layout:
    """The int64 layout of a step's results and, on the asking rank, their tensors in its order."""

    def __init__(self) -> None:
        self.values: list[int] = []
        self.tensors: list[torch.Tensor] = []

    def container(self, what: str, parts: Any) -> None:
        if parts is None:
            self.values.append(ABSENT)
            return
        if not isinstance(parts, (list, tuple)):
            raise TypeError(f"{what} must be a list of per-sample tensors, got {type(parts).__name__}")
        self.values += [TUPLE if isinstance(parts, tuple) else LIST, len(parts)]
        for sample, tensor in enumerate(parts):
            if not isinstance(tensor, torch.Tensor) or tensor.dtype not in DTYPES:
                shown = str(tensor.dtype) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise TypeError(f"{what}[{sample}] is a {shown}: only tensors of {[str(d) for d in DTYPES]} travel "
                                f"between ranks")
            self.values += [DTYPES.index(tensor.dtype), HOST if tensor.device.type == "cpu" else CUDA, tensor.dim(),
                            *tensor.shape]
            self.tensors.append(tensor)


def teacher_index(index: object) -> int:
    """A result's key: a teacher's position in the step, an int of int64's non-negative range."""
    try:
        number = operator.index(index)  # type: ignore[arg-type]
    except TypeError:
        number = None
    if number is None or isinstance(index, bool):
        raise TypeError(f"shared_results(served=...): teacher index {index!r} is no int: key each result by its "
                        "teacher's position in the step")
    if not 0 <= number < INT64_END:
        raise ValueError(f"shared_results(served=...): teacher index {number} is outside 0 .. 2**63 - 1: key each "
                         "result by its teacher's position in the step")
    return number


def layout_of(served: object) -> Layout:
    """The layout of the asking rank's results (TypeError / ValueError for anything that cannot travel)."""
    if not isinstance(served, dict):
        raise TypeError(f"shared_results(served=...) on the asking rank must be a dict {{teacher index: result}}, "
                        f"got {type(served).__name__}")
    layout = Layout()
    layout.values.append(len(served))
    for key, result in served.items():
        index = teacher_index(key)
        if isinstance(result, BatchScores):
            layout.values += [index, SCORES]
            for name in FIELDS:
                layout.container(f"teacher {index}'s scores.{name}", getattr(result, name))
        elif isinstance(result, (list, tuple)):
            layout.values += [index, ROWS]
            layout.container(f"teacher {index}'s result", result)
        else:
            raise TypeError(f"teacher {index}'s result is a {type(result).__name__}: only BatchScores or a list of "
                            f"per-sample tensors travel between ranks")
    return layout


def error_layout(error: Exception) -> list[int]:
    kind = next((i for i, k in enumerate(ERROR_KINDS) if isinstance(error, k)), len(ERROR_KINDS) - 1)
    text = f"TeacherStep: the asking rank could not share its served results: {error}".encode()
    return [ERROR, kind, len(text), *text]


def raise_error(values: list[int], cause: Exception | None) -> None:
    """The asking rank's packing error, of the same kind and words on every rank."""
    kind, length = values[1], values[2]
    raise ERROR_KINDS[kind](bytes(values[3: 3 + length]).decode("utf-8")) from cause


def described(values: list[int]) -> tuple[list[tuple[int, int, int, tuple[int, ...]]], list[Any]]:
    """From a layout: every tensor's (dtype code, device, numel, shape) in order, and the results'
    skeleton (index, kind, containers: (container code, count) per field)."""
    tensors: list[tuple[int, int, int, tuple[int, ...]]] = []
    skeleton: list[Any] = []
    at = 1

    def container() -> tuple[int, int]:
        nonlocal at
        code = values[at]
        at += 1
        if code == ABSENT:
            return code, 0
        count = values[at]
        at += 1
        for _ in range(count):
            dtype, device, dims = values[at: at + 3]
            shape = tuple(values[at + 3: at + 3 + dims])
            at += 3 + dims
            numel = 1
            for size in shape:
                numel *= size
            tensors.append((dtype, device, numel, shape))
        return code, count

    for _ in range(values[0]):
        index, kind = values[at: at + 2]
        at += 2
        skeleton.append((index, kind, [container() for _ in FIELDS] if kind == SCORES else [container()]))
    return tensors, skeleton


def buffers_of(tensors: list[tuple[int, int, int, tuple[int, ...]]], device: torch.device
               ) -> tuple[dict[int, torch.Tensor], list[int]]:
    """One empty flat buffer per dtype code present (on `device`) and each tensor's offset in its own."""
    totals: dict[int, int] = {}
    offsets = []
    for dtype, _, numel, _ in tensors:
        offsets.append(totals.get(dtype, 0))
        totals[dtype] = totals.get(dtype, 0) + numel
    return {code: torch.empty(total, dtype=DTYPES[code], device=device) for code, total in totals.items()}, offsets


def wire(buffer: torch.Tensor) -> torch.Tensor:
    """What a buffer travels as: itself (a dtype every backend broadcasts), or its bytes (uint8):
    int16 (gloo and NCCL refuse it), fp8, bool. A broadcast copies bits, so either arrives exact."""
    return buffer if buffer.dtype in NATIVE else buffer.view(torch.uint8)


STRAY = 1  # a receiving rank's word: it passed results where None is due


def agreed_words(length: int, word: int, group: Any, device: torch.device) -> int:
    """The asking rank's layout length, once every rank's word on its own arguments is known (one
    int64 all-gather, the first collective): a receiving rank's stray results are the same
    ValueError on every rank, naming it."""
    words = gathered(group, on_device(torch.tensor([length, word], dtype=torch.int64), device))
    strays = [position for position, told in enumerate(words) if int(told[1]) == STRAY]
    if strays:
        ranks = dist.get_process_group_ranks(group)
        named = ", ".join(f"rank {ranks[position]}" for position in strays)
        raise ValueError(f"shared_results: {named} of the group passed results (served=...) but only the group's "
                         f"first rank (rank {ranks[0]}) shares: pass None on the others (they receive its results)")
    return int(words[0][0])


def broadcast_layout(values: list[int] | None, length: int, src: int, group: Any, device: torch.device) -> list[int]:
    """The asking rank's layout (`length` int64s) on every rank: one int64 broadcast."""
    layout = on_device(torch.tensor(values, dtype=torch.int64), device) if values is not None else \
        torch.empty(length, dtype=torch.int64, device=device)
    dist.broadcast(layout, src=src, group=group)
    return values if values is not None else layout.cpu().tolist()


def packed(served: object, device: torch.device) -> tuple[list[int], dict[int, torch.Tensor], Exception | None]:
    """On the asking rank: the layout of `served` and its dtypes' filled buffers, or (anything
    wrong with them) the error layout and the error, to be raised alike on every rank."""
    try:
        layout = layout_of(served)
        tensors, _ = described(layout.values)
        buffers, offsets = buffers_of(tensors, device)
        for (code, _, numel, _), offset, tensor in zip(tensors, offsets, layout.tensors):
            buffers[code][offset: offset + numel].copy_(tensor.reshape(-1))
        return layout.values, buffers, None
    except Exception as error:  # noqa: BLE001 - the same error on every rank, sent in the layout
        return error_layout(error), {}, error


def shared_results(served: dict[int, Any] | None, group: Any) -> dict[int, Any]:
    """`served` (the asking rank's results by teacher index; None on the other ranks) on every rank
    of `group`, sent from its first rank as tensors (see the module's docstring). Every rank of the
    group calls it; the asking rank gets `served` itself back. A mistake on any rank (the asking
    rank's results, another's stray ones) is the same error on every rank, none left waiting."""
    position = dist.get_rank(group)
    if position < 0:  # not a member: the group's collectives never wait for it
        raise ValueError(f"shared_results: this rank ({dist.get_rank()}) is not in the group passed: pass its "
                         "sharing group")
    device = group_device(group)
    src = dist.get_global_rank(group, 0)
    asking = position == 0
    values: list[int] | None = None
    buffers: dict[int, torch.Tensor] = {}
    failure: Exception | None = None
    if asking:
        values, buffers, failure = packed(served, device)
    length = agreed_words(len(values) if values is not None else 0, 0 if asking or served is None else STRAY,
                          group, device)
    values = broadcast_layout(values, length, src, group, device)
    if values and values[0] == ERROR:
        raise_error(values, failure)
    tensors, skeleton = described(values)
    if not asking:
        buffers, offsets = buffers_of(tensors, device)
    for code in sorted(buffers):
        dist.broadcast(wire(buffers[code]), src=src, group=group)
    if asking:
        assert served is not None
        return served
    return rebuilt(skeleton, tensors, offsets, buffers)


def rebuilt(skeleton: list[Any], tensors: list[tuple[int, int, int, tuple[int, ...]]], offsets: list[int],
            buffers: dict[int, torch.Tensor]) -> dict[int, Any]:
    """The results from their skeleton, each tensor a view of its dtype's buffer where the asking
    rank held it (a buffer moved to the host once, when the group's device is not)."""
    moved: dict[int, torch.Tensor] = {}  # a buffer moved once (host: its code; CUDA: -1 - code)
    place = iter(zip(tensors, offsets))

    def part() -> torch.Tensor:
        (code, device, numel, shape), offset = next(place)
        buffer = buffers[code]
        if device == HOST and buffer.device.type != "cpu":
            buffer = moved.setdefault(code, buffer.cpu())
        elif device == CUDA and buffer.device.type == "cpu":  # a CUDA tensor shared over gloo
            buffer = moved.setdefault(-1 - code, buffer.cuda())
        return buffer[offset: offset + numel].view(shape)

    def container(code: int, count: int) -> Any:
        if code == ABSENT:
            return None
        parts = [part() for _ in range(count)]
        return tuple(parts) if code == TUPLE else parts

    out: dict[int, Any] = {}
    for index, kind, containers in skeleton:
        made = [container(code, count) for code, count in containers]
        out[index] = BatchScores(**dict(zip(FIELDS, made))) if kind == SCORES else made[0]
    return out
