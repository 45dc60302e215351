"""flash-linear-attention on CPU for slime's own gated-delta-net layers (slime_plugins/models/qwen3_5.py,
qwen3_next.py): slime's layer has no torch path of its own (it builds fla's ShortConvolution and
FusedRMSNormGated and calls fla's chunk_gated_delta_rule, all Triton), so the lane registers an
`fla` whose three names are the torch code transformers runs where fla is absent
(modeling_qwen3_next: causal_conv1d_fn, Qwen3NextRMSNormGated, torch_chunk_gated_delta_rule), in
fla's calling convention: `cu_seqlens` runs each packed sequence on its own, `initial_state` /
`output_final_state` carry one state per sequence.

The recurrence is transformers' chunked rule (its prefill path) or, with `install("token")`, its
token-by-token one: the chunked rule forms exp(g_i - g_j) from cumulative sums of the log-decays
over a 64-row chunk, which in float32 rounds to about 1e-5 of a log-prob under decays as strong as
the lane's teacher snapshots draw (their A_log moved by 0.5 · N(0, 1)), and the plan's chunks start
elsewhere than the packed path's; token by token, nothing is formed across rows. A later
`install` with the other recurrence switches the stand-in's rule (one world runs both).

transformers resolves those functions to fla's when fla is importable at its import, so its module
is imported first (`install` does), then the stand-in registered."""
from __future__ import annotations

import importlib.machinery
import sys
import types
from typing import Any

import torch

NAMES = ("fla", "fla.modules", "fla.ops", "fla.ops.gated_delta_rule")
RECURRENCE: dict[str, Any] = {}  # "rule": the torch rule the stand-in's chunk_gated_delta_rule runs


def _sequences(cu_seqlens: Any, rows: int) -> list[tuple[int, int]]:
    edges = [0, rows] if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]
    return list(zip(edges, edges[1:]))


def install(recurrence: str = "chunk") -> None:
    """Register the stand-in `fla` (idempotent; a real fla already imported is left alone);
    `recurrence`: "chunk" or "token", transformers' torch rule its chunk_gated_delta_rule runs."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    RECURRENCE["rule"] = {"chunk": hf.torch_chunk_gated_delta_rule,
                          "token": hf.torch_recurrent_gated_delta_rule}[recurrence]
    if "fla" in sys.modules:
        return

    class ShortConvolution(torch.nn.Conv1d):
        """fla's depthwise causal convolution ([b, t, d] in and out, then its activation)."""

        def __init__(self, hidden_size: int, kernel_size: int, bias: bool = False, activation: str | None = "silu",
                     device: Any = None, dtype: Any = None, **_: Any) -> None:
            super().__init__(hidden_size, hidden_size, kernel_size, groups=hidden_size, padding=kernel_size - 1,
                             bias=bias, device=device, dtype=dtype)
            self.hidden_size, self.activation = hidden_size, activation

        def forward(self, x: torch.Tensor, residual: Any = None, mask: Any = None, cache: Any = None,
                    output_final_state: bool = False, cu_seqlens: Any = None, **_: Any) -> tuple[torch.Tensor, None]:
            if residual is not None or mask is not None or cache is not None or output_final_state:
                raise NotImplementedError("the lane's ShortConvolution runs without residual, mask or cache")
            if cu_seqlens is not None and x.shape[0] != 1:
                raise ValueError(f"cu_seqlens with a batch of {x.shape[0]} rows")
            lines = x.transpose(1, 2)
            pieces = [hf.causal_conv1d_fn(lines[:, :, start:end], self.weight.squeeze(1), self.bias,
                                          activation=self.activation)
                      for start, end in _sequences(cu_seqlens, x.shape[1])]
            return torch.cat(pieces, dim=2).transpose(1, 2), None

    class FusedRMSNormGated(hf.Qwen3NextRMSNormGated):
        """fla's gated RMSNorm: norm(x) * weight * silu(gate)."""

        def __init__(self, hidden_size: int, elementwise_affine: bool = True, eps: float = 1e-5,
                     activation: str = "swish", device: Any = None, dtype: Any = None, **_: Any) -> None:
            super().__init__(hidden_size, eps=eps)
            if activation not in ("swish", "silu"):
                raise NotImplementedError(f"the lane's FusedRMSNormGated runs silu, not {activation!r}")
            self.to(device=device, dtype=dtype)

    def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, scale: Any = None, initial_state: Any = None,
                               output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                               cu_seqlens: Any = None, **_: Any) -> tuple[torch.Tensor, Any]:
        if scale is not None:
            raise NotImplementedError("the lane's chunk_gated_delta_rule scales queries by dk^-1/2 only")
        rule = RECURRENCE["rule"]
        if cu_seqlens is None:
            return rule(q, k, v, g=g, beta=beta, initial_state=initial_state,
                                                   output_final_state=output_final_state,
                                                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        outs, finals = [], []
        for index, (start, end) in enumerate(_sequences(cu_seqlens, q.shape[1])):
            state = None if initial_state is None else initial_state[index:index + 1]
            out, final = rule(
                q[:, start:end], k[:, start:end], v[:, start:end], g=g[:, start:end], beta=beta[:, start:end],
                initial_state=state, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
            outs.append(out)
            finals.append(final)
        return torch.cat(outs, dim=1), (torch.cat(finals) if output_final_state else None)

    attributes = {"fla.modules": {"ShortConvolution": ShortConvolution, "FusedRMSNormGated": FusedRMSNormGated},
                  "fla.ops.gated_delta_rule": {"chunk_gated_delta_rule": chunk_gated_delta_rule}}
    for name in NAMES:
        module = types.ModuleType(name)
        module.__doc__ = "slime lane stand-in (tests/integrations/slime/lane/slime_fla_cpu.py)"
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=name != NAMES[-1])
        module.__dict__.update(attributes.get(name, {}))
        sys.modules[name] = module
