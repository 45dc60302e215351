"""Where a frozen build's weights live between uses ("resident", "swap", "stream"):
`placement` (the modes at work: on_device, hold, weights_on_host), `budget` (one device cap over
several builds), `storage` (host copies), `units` (the pieces streamed), `reporting`, `host_init`
(building in host memory), `modes` (the mode names, torch-free).

Names resolve lazily (the `memory` CLI imports `modes` without torch); those of the earlier module
`megatron_rl_patches.inference.residency` keep working here."""
from __future__ import annotations

from megatron_rl_patches._lazy import lazy_getattr, lazy_names

_LAZY = lazy_names("""
    modes: RESIDENCY_MODES
    budget: ResidencyBudget
    reporting: residency_report ResidencyReport
    storage: device_weight_bytes
    placement: ATTR Residency attach_residency check_residency_args forward_device hold hold_if_room module_list
        note_activation_bytes on_device release_streamed residency_of weights_on_host
""")

__getattr__ = lazy_getattr(__name__, _LAZY, globals())


def __dir__() -> list[str]:
    return sorted([*_LAZY, *globals()])
