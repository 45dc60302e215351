"""Bytes a trainable Megatron build holds beyond the weights (grad buffer, fp32 main params,
Adam m and v), per data-parallel rank, against the inference-only build (none of them).

Formula per parameter: grad buffer = grad dtype bytes; main params = 4 B when the weights are
bf16/fp16 (fp32 weights are their own main params); Adam m, v = 4 B each. The distributed
optimizer divides main params and Adam state over the DP ranks; the grad buffer stays whole.
Importing this module imports nothing heavy (the `memory` CLI needs no torch)."""
from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, field
from typing import Any

from megatron_rl_patches.model.chunks import as_chunks, has_grad_buffers
from megatron_rl_patches.ops.scoring_plan import positive_int

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_DTYPE_NAMES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
}
MAIN_PARAM_BYTES = 4
ADAM_MOMENT_BYTES = 4


def dtype_name(value: Any, argument: str) -> str:
    """'bf16' | 'fp16' | 'fp32' from a name or a torch.dtype."""
    name = _DTYPE_NAMES.get(str(value).lower())
    if name is None:
        raise ValueError(f"{argument} must be one of bf16, fp16, fp32 (or the torch dtype), got {value!r}")
    return name


@dataclass(frozen=True)
class TrainingStateBytes:
    """Per-rank bytes of the training state a trainable build adds to the weights; the
    inference-only build holds none of it (`inference_only` = 0)."""

    num_params: int
    dp: int
    distributed_optimizer: bool
    param_dtype: str
    grad_dtype: str
    weights: int
    grad_buffer: int
    main_params: int
    adam_m: int
    adam_v: int
    counted_grad_buffer: int | None = None  # real DDP grad buffers, when a DDP model was given
    padding: dict[str, int] = field(default_factory=dict)  # named parts of counted - formula
    inference_only: int = 0

    @property
    def total(self) -> int:
        return self.grad_buffer + self.main_params + self.adam_m + self.adam_v

    @property
    def saved(self) -> int:
        return self.total - self.inference_only

    @property
    def bytes_per_param(self) -> float:
        return self.total / self.num_params if self.num_params else 0.0

    @property
    def grad_buffer_padding(self) -> int | None:
        return None if self.counted_grad_buffer is None else self.counted_grad_buffer - self.grad_buffer

    def components(self) -> list[tuple[str, int]]:
        main = f"main params (fp32, {'none: fp32 weights' if self.param_dtype == 'fp32' else 'copy of the weights'})"
        return [
            (f"grad buffer ({self.grad_dtype})", self.grad_buffer),
            (main, self.main_params),
            ("Adam m (fp32)", self.adam_m),
            ("Adam v (fp32)", self.adam_v),
        ]

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(
            total=self.total,
            saved=self.saved,
            bytes_per_param=self.bytes_per_param,
            grad_buffer_padding=self.grad_buffer_padding,
        )
        return data


def _param_count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError
    if not (math.isfinite(value) and value >= 0 and float(value).is_integer()):
        raise ValueError(f"model_or_num_params must be a whole, non-negative number of parameters, got {value!r}")
    return int(value)


def _count_ddp(ddp: Any) -> dict[str, Any]:
    """Params, dtypes, DP size and grad-buffer bytes (with named padding) of a megatron-core DDP."""
    buffers = list(getattr(ddp, "buffers", [])) + list(getattr(ddp, "expert_parallel_buffers", []))
    params = grad_bytes = align = bucket_end = 0
    facts: dict[str, Any] = {"distributed_optimizer": bool(ddp.ddp_config.use_distributed_optimizer)}
    for buf in buffers:
        size = buf.grad_data.element_size()
        in_buffer = sum(p.numel() for p in buf.params)
        params += in_buffer
        grad_bytes += buf.grad_data.numel() * size
        bucket_end += (buf.numel - buf.numel_unpadded) * size
        align += (buf.numel_unpadded - in_buffer) * size
        facts.setdefault("dp", buf.data_parallel_world_size)
        facts.setdefault("grad_dtype", dtype_name(buf.grad_dtype, "grad dtype"))
        facts.setdefault("param_dtype", dtype_name(buf.param_dtype, "param dtype"))
    facts.update(num_params=params, counted=grad_bytes)
    facts["padding"] = {
        "param start alignment (64 elements)": align,
        "bucket end (multiple of lcm(dp, 128))": bucket_end,
    }
    return facts


def _count_module(module: Any) -> dict[str, Any]:
    """All (unique) parameters of a plain module, counted per dtype."""
    by_dtype: dict[str, int] = {}
    for param in module.parameters():
        name = _DTYPE_NAMES.get(str(param.dtype))
        if name is not None:
            by_dtype[name] = by_dtype.get(name, 0) + param.numel()
    return {"num_params": sum(p.numel() for p in module.parameters()), "by_dtype": by_dtype}


def _inspect(model: Any) -> dict[str, Any]:
    chunks = as_chunks(model)
    if not chunks:
        raise ValueError("model_or_num_params: an empty list of model chunks")
    parts = []
    for chunk in chunks:
        if has_grad_buffers(chunk):
            parts.append(_count_ddp(chunk))
        elif hasattr(chunk, "parameters"):
            parts.append(_count_module(chunk))
        else:
            raise TypeError(
                "model_or_num_params must be a number of parameters, a torch.nn.Module, a megatron-core "
                f"DistributedDataParallel or a list of them, got {type(chunk).__name__}"
            )
    facts: dict[str, Any] = {"num_params": sum(p["num_params"] for p in parts)}
    for key in ("dp", "distributed_optimizer", "grad_dtype", "param_dtype"):
        values = {p[key] for p in parts if key in p}
        if len(values) > 1:
            raise ValueError(f"model chunks disagree on {key}: {sorted(map(str, values))}")
        if values:
            facts[key] = values.pop()
    by_dtype: dict[str, int] = {}
    for part in parts:
        for name, count in part.get("by_dtype", {}).items():
            by_dtype[name] = by_dtype.get(name, 0) + count
    if "param_dtype" not in facts and by_dtype:  # plain modules: the dtype holding most parameters
        facts["param_dtype"] = max(by_dtype, key=by_dtype.__getitem__)
    if all("counted" in p for p in parts):
        facts["counted"] = sum(p["counted"] for p in parts)
        facts["padding"] = {k: sum(p["padding"][k] for p in parts) for k in parts[0]["padding"]}
    return facts


def _resolve(name: str, given: Any, facts: dict[str, Any], default: Any, is_ddp: bool) -> Any:
    if name not in facts:
        return default if given is None else given
    if given is not None and given != facts[name] and is_ddp:
        raise ValueError(
            f"{name}={given!r} contradicts the DDP model, which was built with {name}={facts[name]!r}; "
            f"leave {name} out to use the model's own"
        )
    return facts[name] if given is None else given


def training_state_bytes(
    model_or_num_params: Any,
    *,
    dp: int | None = None,
    distributed_optimizer: bool | None = None,
    param_dtype: Any = None,
    grad_dtype: Any = None,
) -> TrainingStateBytes:
    """Per-rank training-state bytes for a parameter count, a module, a megatron-core DDP model
    (then also its real, padded grad-buffer bytes) or a list of chunks. Unset options come from
    the DDP model, else dp=1, no distributed optimizer, bf16 weights, fp32 grads."""
    facts: dict[str, Any]
    try:
        facts = {"num_params": _param_count(model_or_num_params)}
    except TypeError:
        facts = _inspect(model_or_num_params)
    is_ddp = "counted" in facts
    if param_dtype is not None:
        param_dtype = dtype_name(param_dtype, "param_dtype")
    if grad_dtype is not None:
        grad_dtype = dtype_name(grad_dtype, "grad_dtype")
    if dp is not None:
        dp = positive_int("dp", dp)
    if distributed_optimizer is not None and not isinstance(distributed_optimizer, bool):
        raise TypeError(f"distributed_optimizer must be a bool, got {type(distributed_optimizer).__name__}")
    dp = _resolve("dp", dp, facts, 1, is_ddp)
    dist_opt = _resolve("distributed_optimizer", distributed_optimizer, facts, False, is_ddp)
    p_dtype = _resolve("param_dtype", param_dtype, facts, "bf16", is_ddp)
    g_dtype = _resolve("grad_dtype", grad_dtype, facts, "fp32", is_ddp)
    if g_dtype not in ("fp32", p_dtype):
        raise ValueError(
            f"grad_dtype={g_dtype!r} with param_dtype={p_dtype!r}: Megatron's grad buffer is fp32 "
            "(grad_reduce_in_fp32) or the parameters' own dtype"
        )
    n = facts["num_params"]
    shard = -(-n // dp) if dist_opt else n  # optimizer state per rank
    return TrainingStateBytes(
        num_params=n,
        dp=dp,
        distributed_optimizer=dist_opt,
        param_dtype=p_dtype,
        grad_dtype=g_dtype,
        weights=n * DTYPE_BYTES[p_dtype],
        grad_buffer=n * DTYPE_BYTES[g_dtype],
        main_params=0 if p_dtype == "fp32" else shard * MAIN_PARAM_BYTES,
        adam_m=shard * ADAM_MOMENT_BYTES,
        adam_v=shard * ADAM_MOMENT_BYTES,
        counted_grad_buffer=facts.get("counted"),
        padding=dict(facts.get("padding", {})),
    )
