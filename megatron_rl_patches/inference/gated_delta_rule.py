"""The gated delta rule (the recurrence of Qwen3.5's and Qwen3-Next's linear-attention layers) and
its causal depthwise convolution in plain torch, for CPU and wherever flash-linear-attention is
absent. Per value head, with a state S [dk, dv]: S <- exp(g_t) S, u_t = beta_t (v_t - S^T k_t),
S <- S + k_t u_t^T, o_t = S^T q_t. Computed a chunk at a time: inside a chunk the updates form a
unit lower-triangular system, solved once; the state is carried from chunk to chunk, from a given
initial state if any, and returned at the end if asked (`chunk_gated_delta_rule`, in
flash-linear-attention's calling convention: a shared prefix's remainders continue its state)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def l2_normalized(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dimension (flash-linear-attention's l2norm)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def causal_depthwise_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Channel-wise causal convolution of x [b, channels, t] by weight [channels, 1, kernel]: each
    output position sees its own and the kernel-1 earlier inputs of the same sequence."""
    kernel = weight.shape[-1]
    return F.conv1d(F.pad(x, (kernel - 1, 0)), weight, groups=x.shape[1])


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     chunk: int = CHUNK) -> torch.Tensor:
    """o [b, t, h, dv] of queries / keys [b, t, h, dk] (already normalized), values [b, t, h, dv],
    log-decays g and write strengths beta [b, t, h]; in float32, from a zero state. Queries are
    scaled by dk^-1/2."""
    return chunk_gated_delta_rule(q, k, v, g, beta, chunk=chunk)[0]


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False, chunk: int = CHUNK,
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`gated_delta_rule` from `initial_state` [b, h, dk, dv] (zeros if None), with the final state
    (float32, differentiable in the initial one) when `output_final_state`; queries and keys
    normalized first when `use_qk_l2norm_in_kernel` (flash-linear-attention's arguments)."""
    dtype = v.dtype
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalized(q.float()), l2_normalized(k.float())
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))  # [b, h, t, d]
    g, beta = (x.float().transpose(1, 2) for x in (g, beta))  # [b, h, t]
    q = q * dk ** -0.5
    pad = -t % chunk
    if pad:  # a padded row: no write (beta 0), no decay (g 0): the final state is the last real row's
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (t + pad) // chunk
    q, k, v = (x.reshape(b, h, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, chunk), beta.reshape(b, h, n, chunk)
    decay = g.cumsum(-1)  # log of the decay from the chunk's start to each position (inclusive)
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)  # j > i
    # exp(decay_i - decay_j) for j <= i; 0 above the diagonal (masked before exp: no overflow)
    between = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(later, float("-inf")).exp()
    # u = beta v - beta exp(decay) K S0 - sum_{j<i} beta_i exp(decay_i - decay_j) (k_i . k_j) u_j
    system = (k @ k.transpose(-1, -2)) * between * beta.unsqueeze(-1)
    system = system.tril(-1) + torch.eye(chunk, dtype=system.dtype, device=system.device)
    rhs = torch.cat([v * beta.unsqueeze(-1), k * (beta * decay.exp()).unsqueeze(-1)], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    new_values, state_reads = solved[..., :dv], solved[..., dv:]  # u = new_values - state_reads @ S0
    scores = (q @ k.transpose(-1, -2)) * between  # (q_i . k_j) exp(decay_i - decay_j), j <= i
    q_decayed = q * decay.exp().unsqueeze(-1)
    k_to_end = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)
    state = q.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.float()
    pieces = []
    for i in range(n):
        u = new_values[:, :, i] - state_reads[:, :, i] @ state
        pieces.append(q_decayed[:, :, i] @ state + scores[:, :, i] @ u)
        state = state * decay[:, :, i, -1, None, None].exp() + k_to_end[:, :, i].transpose(-1, -2) @ u
    out = torch.stack(pieces, dim=2).reshape(b, h, n * chunk, dv)[:, :, :t].transpose(1, 2).to(dtype)
    return out, (state if output_final_state else None)
