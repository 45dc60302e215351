"""Layer-major scoring: every micro-batch through layer i before layer i+1 (`scoring`), the
decoder run one layer at a time through the model's own forward (`decoder_steps`), and the hidden
states kept between layers (`activation_store`).

`score_layer_major` and `ActivationStats` resolve lazily here, as they did from the earlier module
`megatron_rl_patches.inference.layer_major`."""
from __future__ import annotations

from megatron_rl_patches._lazy import lazy_getattr, lazy_names

_LAZY = lazy_names("""
    scoring: score_layer_major
    activation_store: ActivationStats
""")

__getattr__ = lazy_getattr(__name__, _LAZY, globals())


def __dir__() -> list[str]:
    return sorted([*_LAZY, *globals()])
