"""Gated delta nets (Qwen3.5's and Qwen3-Next's linear attention): a remainder continues its prefix's
recurrent state and convolution window, computed once.

- megatron-core 0.16's `GatedDeltaNet`: its class becomes one whose forward runs the plan's segments
  (`gated_delta_net.prepare_gated_delta_net`), reading the module's own weights and widths: its
  `__init__` must be megatron-core's too;
- the package's inference layer (`inference.gated_delta_net.GatedDeltaNetLayer`, marked there): it
  reads the plan itself and runs it at one context-parallel rank (refused by name beyond);
- any other class named a gated delta net (megatron-core 0.19's, a framework's no kind registered)
  is refused by name: each remainder would start from the prefix's final recurrent state, which
  only a kind that runs it planned hands on."""
from __future__ import annotations

from typing import Any

from megatron_rl_patches.model.kinds import qualified_name
from megatron_rl_patches.shared_prefix.gated_delta_net import prepare_gated_delta_net
from megatron_rl_patches.shared_prefix.kinds.fields import per_token, rows
from megatron_rl_patches.shared_prefix.kinds.kind import ByCode, Continuation, RefusedByName

# what a shared segment hands a gated delta net's continuation: its convolution's last rows and its final state
WINDOW, STATE = "gdn-window", "gdn-state"
RECURRENT = Continuation(roles=(WINDOW, STATE), along_rows=True)


class MegatronGatedDeltaNet(ByCode):
    def prepare(self, module: Any) -> bool:
        prepare_gated_delta_net(module)
        return True


class PackageGatedDeltaNet(ByCode):
    def reason(self, module: Any, path: str) -> str | None:
        if int(getattr(module, "cp_size", 1)) <= 1:
            return None
        return (f"the package's gated delta net ({qualified_name(type(module))} at {path}) at context parallelism "
                f"(context-parallel size {module.cp_size}): it runs a plan's stream at one rank; run it at "
                "context_parallel_size=1")


MEGATRON_GATED_DELTA_NET = MegatronGatedDeltaNet(
    "megatron-core's gated delta net", classes=("megatron.core.ssm.gated_delta_net:GatedDeltaNet",), whole=True,
    fields=rows({}, {per_token("the widths of a gated delta net or of DSA's indexer, its top-k and its per-token "
                               "scoring (exact under the plan's rule; top-k ties broken by stream order, as in any "
                               "packing)"): """linear_attention_freq linear_conv_kernel_dim linear_key_head_dim
        linear_value_head_dim linear_num_key_heads linear_num_value_heads"""}), continuation=RECURRENT)
PACKAGE_GATED_DELTA_NET = PackageGatedDeltaNet("the package's gated delta net", whole=True, continuation=RECURRENT)
UNSERVED_GATED_DELTA_NET = RefusedByName(
    "Qwen3.5's gated delta net layers (each remainder would start from the prefix's final recurrent state)",
    named="GatedDeltaNet", continuation=Continuation(along_rows=True))
