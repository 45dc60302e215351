"""Device and host weight bytes of a frozen model per residency mode, from its size alone (the
`memory --residency` planner). Imports nothing heavy: the CLI runs without torch.

resident: every weight on the device for the whole job. swap: the whole model on the device during
a scoring phase, none between; host memory holds a copy. stream: `prefetch + 1` layers plus the
larger of the embedding and the output layer at once; host memory holds a copy. Host bytes are
per data-parallel rank: each rank keeps its own (pinned) copy of its model-parallel shard."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from megatron_rl_patches.inference.residency.modes import RESIDENCY_MODES
from megatron_rl_patches.inference.sizing.memory import DTYPE_BYTES, dtype_name
from megatron_rl_patches.ops.scoring_plan import positive_int

MODES = RESIDENCY_MODES  # the `memory --residency` choices


@dataclass(frozen=True)
class ResidencyBytes:
    """One mode's weight bytes per rank: on the device at most, between phases, and in host memory."""

    mode: str
    device_peak: int
    device_between_phases: int
    host: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ResidencyPlan:
    """The three modes for one model, with the per-piece sizes they come from."""

    num_params: int
    layers: int
    prefetch: int
    param_dtype: str
    layer_bytes: int
    embedding_bytes: int
    output_bytes: int
    modes: tuple[ResidencyBytes, ...]

    def mode(self, name: str) -> ResidencyBytes:
        return next(m for m in self.modes if m.mode == name)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["modes"] = {m.mode: m.as_dict() for m in self.modes}
        return data


def residency_plan(
    num_params: int,
    *,
    layers: int,
    prefetch: int = 1,
    param_dtype: Any = "bf16",
    vocab_size: int | None = None,
    hidden_size: int | None = None,
    tied: bool = False,
    tp: int = 1,
) -> ResidencyPlan:
    """Weight bytes per mode for a model of `num_params` parameters in `layers` transformer layers
    (the embedding and output layer from `vocab_size` x `hidden_size` when given, else counted as
    layers' weights); `tp` divides everything (each rank holds its shard)."""
    n = positive_int("num_params", num_params)
    layers = positive_int("layers", layers)
    tp = positive_int("tp", tp)
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an int >= 0 (layers copied ahead), got {prefetch!r}")
    if (vocab_size is None) != (hidden_size is None):
        raise ValueError(
            "give vocab_size and hidden_size together (the embedding is vocab_size x hidden_size), or neither"
        )
    size = DTYPE_BYTES[dtype_name(param_dtype, "param_dtype")]
    table = 0
    if vocab_size is not None and hidden_size is not None:
        table = positive_int("vocab_size", vocab_size) * positive_int("hidden_size", hidden_size)
    embedding, output = table, (0 if tied else table)
    in_layers = n - embedding - output
    if in_layers <= 0:
        raise ValueError(
            f"num_params={n:,} leaves nothing for the layers after the embedding and output layer "
            f"({embedding + output:,} parameters): check --params, --vocab and --hidden"
        )
    if in_layers < layers:
        raise ValueError(
            f"num_params={n:,} leaves {in_layers:,} parameters for {layers:,} layers, fewer than one per layer: "
            "check --params (the whole model's count, e.g. 27e9) and --layers"
        )
    per_layer = -(-in_layers // layers)
    weights = -(-n * size // tp)
    layer_bytes = -(-per_layer * size // tp)
    ends = -(-max(embedding, output) * size // tp)
    stream_peak = min(weights, (min(prefetch, layers - 1) + 1) * layer_bytes + ends)
    return ResidencyPlan(
        num_params=n,
        layers=layers,
        prefetch=prefetch,
        param_dtype=dtype_name(param_dtype, "param_dtype"),
        layer_bytes=layer_bytes,
        embedding_bytes=-(-embedding * size // tp),
        output_bytes=-(-output * size // tp),
        modes=(
            ResidencyBytes("resident", weights, weights, 0),
            ResidencyBytes("swap", weights, 0, weights),
            ResidencyBytes("stream", stream_peak, 0, weights),
        ),
    )
