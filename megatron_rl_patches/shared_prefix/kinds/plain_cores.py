"""Plain attention cores: megatron-core's local `DotProductAttention`, Transformer Engine's
`TEDotProductAttention`, and the cores marked `known_as(PLAIN_CORES)` where they are defined (the
package's SDPA core, the test kit's packed and context-parallel cores): causal softmax attention
over queries, keys and values, at the config's scale (or the scale multi-latent attention hands
its core), with the config's window and sink.

Under a plan the core's class becomes a subclass (`shared_prefix_core_class`) that runs the
package's attention over the plan (`attention.shared_prefix_attention`, the same arithmetic) and
calls its own class otherwise. Both the core's forward and its `__init__` must be a known class's
own: a subclass with a forward of its own computes something else, and one with an `__init__` of its
own may set what the package's attention would not read (its own softmax scale, say); either is
refused by name."""
from __future__ import annotations

import functools
import math
from typing import Any

from megatron_rl_patches.model.attention_layout import with_batch
from megatron_rl_patches.shared_prefix.attention import shared_prefix_attention
from megatron_rl_patches.shared_prefix.context_parallel import gathered_stream, module_share
from megatron_rl_patches.shared_prefix.kinds.kind import ByCode, Continuation
from megatron_rl_patches.shared_prefix.kinds.windows_sinks import attention_sink, layer_window
from megatron_rl_patches.shared_prefix.plan import shared_prefix_plan_of
from megatron_rl_patches.shared_prefix.prepared import Prepared

KEYS, VALUES = "key", "value"  # what a shared segment hands a core's continuation: its keys and values


class SharedPrefixCore(Prepared):
    """The mark of a core attention whose class `shared_prefix_core_class` made."""


@functools.cache
def shared_prefix_core_class(cls: Any) -> type:
    """`cls` (a core attention class) whose forward takes a plan's route: the package's attention
    over the plan; any other call: `cls.forward` as it is."""

    def forward(self: Any, query: Any, key: Any, value: Any, attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
        params: Any = kwargs.get("packed_seq_params")
        plan = shared_prefix_plan_of(params)
        if plan is None:
            return cls.forward(self, query, key, value, attention_mask, *args, **kwargs)
        if kwargs.get("attention_bias") is not None:
            raise ValueError("shared prefix: an attention bias is not taken with a shared-prefix plan")
        config = self.config
        scale = config.softmax_scale if getattr(config, "softmax_scale", None) else 1.0 / math.sqrt(query.size(-1))
        if getattr(config, "multi_latent_attention", False):
            scale = self.softmax_scale  # MLA hands its core its own scale (YaRN's mscale squared in it)
        dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0) if self.training else 0.0
        held = module_share(self, plan, params)
        if held is not None:  # this rank's queries against every rank's keys and values
            share, group = held
            key, value = (gathered_stream(t, plan, share, group) for t in with_batch(key, value))
            query = with_batch(query)[0]
        return shared_prefix_attention(query, key, value, plan, scale=scale, dropout=dropout, route=params.route,
                                       window=layer_window(config, getattr(self, "layer_number", 1)),
                                       sink=attention_sink(self),
                                       share=None if held is None else (held[0].size, held[0].rank))

    return type(f"SharedPrefix{cls.__name__}", (cls, SharedPrefixCore),
                {"forward": forward, "__module__": cls.__module__, "__doc__": cls.__doc__})


class PlainCores(ByCode):
    def prepare(self, module: Any) -> bool:
        if not isinstance(module, SharedPrefixCore):
            module.__class__ = shared_prefix_core_class(module.__class__)
        return True


PLAIN_CORES = PlainCores("plain attention core", whole=True, classes=(
    "megatron.core.transformer.dot_product_attention:DotProductAttention",
    "megatron.core.extensions.transformer_engine:TEDotProductAttention"),
    continuation=Continuation(roles=(KEYS, VALUES)))  # at their own positions, grouped heads kept grouped
