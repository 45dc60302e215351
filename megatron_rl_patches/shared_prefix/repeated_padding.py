"""Whether a model computes every row of a padding sequence of one repeated id alike, so that a plan
may compute such a sequence on one row (`plan_shared_prefix(..., repeated_padding_once=True)`): the
doors ask it of their model, since slime pads each micro-batch with id 0 to a multiple of 128 x TP.

Row p of a run of one id attends rows 0..p of the run, whose values are alike: their weighted mean
is that value whatever the weights (rotary positions move the weights alone; a window narrows them;
multi-latent and DSA attention alike), and every other layer acts on each row alone, so row p equals
row 0 at every layer, and every statistic reading the rows (the MoE router's, the MTP loss) counts
them alike. That fails where a row reads its own position (learned absolute position embeddings),
where the weights need not sum to one (an attention sink: `softmax_type` off-by-one or learnable),
and where a layer carries a state along the rows (a kind whose continuation says so: megatron-core's,
a framework's and the package's gated delta nets; Mamba). A kind a plan does not know is refused by
`refusals` before any of this."""
from __future__ import annotations

from typing import Any

from megatron_rl_patches.model.chunks import modules_of
from megatron_rl_patches.model.kinds import is_language_model
from megatron_rl_patches.ops.agreement import agreed_min, world
from megatron_rl_patches.shared_prefix.kinds import model_kinds


def repeated_padding_alike(model: Any, group: Any = None) -> bool:
    """Whether `model` (its chunks) computes every row of a run of one id alike (see the module) on
    every rank of `group` (None: the world when torch.distributed is initialized): the same answer on
    every rank, so every pipeline stage lays a micro-batch's padding out alike. Call it on every rank,
    before the pass's first collective."""
    return bool(agreed_min(group if group is not None else world(), int(_alike_here(model))))


def _alike_here(model: Any) -> bool:
    for module in modules_of(model, "repeated_padding_alike"):
        if is_language_model(module) and getattr(module, "position_embedding_type", None) == "learned_absolute":
            return False
        if getattr(getattr(module, "config", None), "softmax_type", None) not in (None, "vanilla"):
            return False
        if carries_state(module):
            return False
    return True


def carries_state(module: Any) -> bool:
    """Whether a kind that recognizes `module` carries a state along the rows (a recurrence: megatron-core's,
    the package's and a framework's registered gated delta nets, Mamba)."""
    return any(kind.continuation.along_rows for kind in model_kinds() if kind.recognizes(module))
