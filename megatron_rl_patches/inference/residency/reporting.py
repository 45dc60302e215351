"""residency_report: where a build's weights are (device now and at peak, host), the copies made
and the bytes moved, for logs and for the demo; resident builds report their device bytes too."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from megatron_rl_patches.inference.residency.placement import module_list, residency_of
from megatron_rl_patches.inference.residency.storage import device_weight_bytes

DP_NOTE = "host_bytes is per data-parallel rank: each rank keeps its own (pinned) host copy of its shard"


@dataclass(frozen=True)
class ResidencyReport:
    """Where a build's weights are: device bytes now and at peak (weights; activations apart),
    host bytes (per data-parallel rank), copies made and bytes moved host to device."""

    mode: str
    prefetch: int
    device_weight_bytes: int
    peak_device_weight_bytes: int
    resident_weight_bytes: int  # what the same model holds on the device built resident
    activation_bytes: int
    peak_activation_bytes: int
    host_bytes: int
    host_pinned: bool
    copies: int
    bytes_moved: int
    copies_by_unit: dict[str, int] = field(default_factory=dict)
    budget: dict[str, int] | None = None
    note: str = DP_NOTE

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def residency_report(chunks: Any) -> ResidencyReport:
    """The residency figures of a build (`build_inference_model`'s chunks)."""
    found = module_list(chunks, "chunks")
    owner = residency_of(found)
    if owner is not None:
        owner.adopt_idle()  # host copies user code replaced (.double(), .to()) are counted as host bytes
    params = [p for chunk in found for p in chunk.parameters()]
    now = device_weight_bytes(params)
    if owner is None:
        return ResidencyReport("resident", 0, now, now, now, 0, 0, 0, False, 0, 0)
    return ResidencyReport(
        mode=owner.mode,
        prefetch=owner.prefetch,
        device_weight_bytes=now,
        peak_device_weight_bytes=owner.peak_device_bytes,
        resident_weight_bytes=owner.resident_bytes,
        activation_bytes=owner.activation_bytes,
        peak_activation_bytes=owner.peak_activation_bytes,
        host_bytes=owner.host.nbytes,
        host_pinned=owner.host.pinned,
        copies=owner.copies,
        bytes_moved=owner.bytes_moved,
        copies_by_unit={unit.name: unit.copies for unit in owner.units},
        budget=None if owner.budget is None else owner.budget.as_dict(),
    )

