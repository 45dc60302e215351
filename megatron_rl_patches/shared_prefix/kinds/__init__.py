"""The model kinds a shared-prefix plan knows, one object each (the protocol: `kind.ModelKind`): the
classes it recognizes by their code, what it prepares on a module, what it refuses and why, and the
config fields it owns. `refusals`, `model_hooks` and `known_config` read every kind through
`model_kinds()`; none holds a list of classes of its own.

A new kind is one module here holding its object (`latent_attention.py` shows the size) and one line
in `KINDS`. A framework's own layer is a kind of its framework's integration, registered where that
framework's patches run (`register`: slime's gated delta net, `integrations/slime/model_kinds.py`), never
named here."""
from __future__ import annotations

from megatron_rl_patches.shared_prefix.kinds.attention_layers import ATTENTION_LAYERS
from megatron_rl_patches.shared_prefix.kinds.dsa import SPARSE_ATTENTION
from megatron_rl_patches.shared_prefix.kinds.gated_delta_nets import (
    MEGATRON_GATED_DELTA_NET,
    PACKAGE_GATED_DELTA_NET,
    UNSERVED_GATED_DELTA_NET,
)
from megatron_rl_patches.shared_prefix.kinds.kind import ModelKind
from megatron_rl_patches.shared_prefix.kinds.language_models import LANGUAGE_MODELS
from megatron_rl_patches.shared_prefix.kinds.latent_attention import LATENT_ATTENTION
from megatron_rl_patches.shared_prefix.kinds.mamba import MAMBA
from megatron_rl_patches.shared_prefix.kinds.moe import MOE_LAYERS
from megatron_rl_patches.shared_prefix.kinds.multi_token_prediction import MULTI_TOKEN_PREDICTION
from megatron_rl_patches.shared_prefix.kinds.pass_through import PASS_THROUGH
from megatron_rl_patches.shared_prefix.kinds.plain_cores import PLAIN_CORES
from megatron_rl_patches.shared_prefix.kinds.windows_sinks import WINDOWS_SINKS

KINDS: tuple[ModelKind, ...] = (  # in the order their refusals are read and their seams installed
    LANGUAGE_MODELS,
    PASS_THROUGH,
    ATTENTION_LAYERS,
    LATENT_ATTENTION,
    PLAIN_CORES,
    WINDOWS_SINKS,
    SPARSE_ATTENTION,
    MULTI_TOKEN_PREDICTION,
    MOE_LAYERS,
    MEGATRON_GATED_DELTA_NET,
    PACKAGE_GATED_DELTA_NET,
    UNSERVED_GATED_DELTA_NET,
    MAMBA,
)
_REGISTERED: list[ModelKind] = []  # a framework's kinds, registered where its patches run


def register(kind: ModelKind) -> None:
    """Add a framework's kind (its own layer, or what of it the plan refuses by name); once per kind
    object, however often its framework's door calls this."""
    if not any(kind is known for known in _REGISTERED):
        _REGISTERED.append(kind)


def model_kinds() -> tuple[ModelKind, ...]:
    """Every kind, a framework's registered ones first (the most specific: their refusals are read
    before the built-in kinds')."""
    return (*_REGISTERED, *KINDS)
