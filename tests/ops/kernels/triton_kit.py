"""Shared by the Triton kernel tests: the device they run on (CUDA when present, else CPU under
Triton's interpreter), inputs, float64 references and the two public routes (logits, hidden)."""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode  # the documented __torch_dispatch__ mode

from megatron_rl_patches import (
    lm_head_log_probs_and_entropy,
    lm_head_topk_logprobs,
    log_probs_and_entropy,
    topk_logprobs,
)
from megatron_rl_patches.testing.logprob_reference import reference_log_probs, scaled_logits

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def require_kernels() -> None:
    """Skip the calling module where the kernels cannot run: no triton, or CPU without the
    interpreter chosen before the kernels were imported (the Makefile exports TRITON_INTERPRET=1)."""
    pytest.importorskip("triton", reason="triton is not installed on this lane")
    from megatron_rl_patches.ops.kernels.triton import backend

    why = backend.TritonTiles().available(DEVICE)
    if why is not None:
        pytest.skip(f"Triton kernels cannot run here: {why}", allow_module_level=True)


@dataclass(frozen=True)
class Inputs:
    hidden: torch.Tensor  # [T, H] float64 (values exact in the case's dtype)
    weight: torch.Tensor  # [V, H]
    tokens: torch.Tensor
    keep: torch.Tensor  # [T, V] bool, the target always kept
    tau: torch.Tensor  # [T]
    ids: torch.Tensor  # [T, k] distinct ids below the valid vocabulary
    a: torch.Tensor
    b: torch.Tensor


def make_inputs(dtype: torch.dtype, T: int = 24, H: int = 40, V: int = 72, n_valid: int = 72, k: int = 5,
                seed: int = 0) -> Inputs:
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(T, H, generator=g) * 1.5).to(dtype).double()
    weight = (torch.randn(V, H, generator=g) * H**-0.5 * 2).to(dtype).double()
    tokens = torch.randint(0, n_valid, (T,), generator=g)
    keep = torch.rand(T, V, generator=g) < 0.5
    keep[torch.arange(T), tokens] = True
    tau = torch.rand(T, generator=g) + 0.5
    ids = torch.stack([torch.randperm(n_valid, generator=g)[:k] for _ in range(T)])
    return Inputs(hidden, weight, tokens, keep, tau, ids, torch.randn(T, generator=g), torch.randn(T, generator=g))


def leaves(x: Inputs, dtype: torch.dtype, fused: bool, reference: bool) -> tuple[torch.Tensor, ...]:
    """The route's differentiable inputs: (hidden, weight) or (logits,) in `dtype` on DEVICE; for
    the reference the same values as float64 on CPU (logits rounded to `dtype` first, as given)."""
    if fused:
        tensors = (x.hidden, x.weight)
    else:
        tensors = ((x.hidden.to(dtype) @ x.weight.to(dtype).t()).double(),)
    if reference:
        return tuple(t.clone().requires_grad_() for t in tensors)
    return tuple(t.to(dtype).to(DEVICE).requires_grad_() for t in tensors)


def _logits64(tensors: tuple[torch.Tensor, ...], n_valid: int) -> torch.Tensor:
    return tensors[0] @ tensors[1][:n_valid].t() if len(tensors) == 2 else tensors[0][:, :n_valid]


def log_prob_run(x: Inputs, *, backend: str | None, fused: bool, dtype: torch.dtype, entropy: bool, masked: bool,
                 row_tau: bool, n_valid: int, lp_grad: bool = True, entropy_grad: bool = True,
                 inplace: bool = False, chunk_size: int | None = None) -> list[torch.Tensor]:
    """[log_probs, entropy (or empty), grads...] as float64 CPU tensors. backend None: the float64
    reference by plain autograd on the valid columns."""
    tau = x.tau if row_tau else 0.7
    tensors = leaves(x, dtype, fused, backend is None)
    if backend is None:
        lp, ent = reference_log_probs(_logits64(tensors, n_valid), x.tokens, temperature=tau,
                                      keep_mask=x.keep if masked else None)
        ent = ent if entropy else lp.new_empty(0)
    else:
        kwargs = dict(with_entropy=entropy, entropy_requires_grad=entropy_grad, vocab_size=n_valid, backend=backend,
                      chunk_size=chunk_size,
                      temperature=tau.to(DEVICE) if row_tau else tau,
                      keep_mask=x.keep.to(DEVICE) if masked else None)
        if fused:
            lp, ent = lm_head_log_probs_and_entropy(*tensors, x.tokens.to(DEVICE), **kwargs)
        else:
            lp, ent = log_probs_and_entropy(*tensors, x.tokens.to(DEVICE), inplace_backward=inplace, **kwargs)
        ent = ent if entropy else lp.new_empty(0)
    loss = (lp * x.a.to(lp)).sum() if lp_grad else 0.0
    if entropy and entropy_grad:
        loss = loss + (ent * x.b.to(ent)).sum()
    loss.backward()
    return [t.detach().double().cpu() for t in (lp, ent, *(leaf.grad for leaf in tensors))]


def topk_run(x: Inputs, *, backend: str | None, fused: bool, dtype: torch.dtype, n_valid: int,
             grads: tuple[float, float] = (0.3, 1.0)) -> list[torch.Tensor]:
    """[log p at ids, log tail mass, grads...] as float64 CPU tensors (backend None: float64 reference)."""
    tensors = leaves(x, dtype, fused, backend is None)
    if backend is None:
        logp_all = torch.log_softmax(scaled_logits(_logits64(tensors, n_valid), x.tau, None), -1)
        lp = logp_all.gather(1, x.ids)
        tail = torch.logsumexp(logp_all.scatter(1, x.ids, -torch.inf), -1)
    else:
        kwargs = dict(temperature=x.tau.to(DEVICE), vocab_size=n_valid, backend=backend)
        op = lm_head_topk_logprobs if fused else topk_logprobs
        lp, tail = op(*tensors, x.ids.to(DEVICE), **kwargs)
    loss = 0.0
    if grads[0]:
        loss = lp.sum() * grads[0]
    if grads[1]:
        loss = loss + tail.sum() * grads[1]
    loss.backward()
    return [t.detach().double().cpu() for t in (lp, tail, *(leaf.grad for leaf in tensors))]


def assert_close(got: list[torch.Tensor], want: list[torch.Tensor], names: tuple[str, ...], rel: float) -> None:
    """Each pair within `rel` times the larger of 1 and the reference's largest magnitude."""
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape, (name, g.shape, w.shape)
        if w.numel() == 0:
            continue
        scale = max(1.0, float(w.abs().max()))
        err = float((g - w).abs().max())
        assert err <= rel * scale, f"{name}: max error {err:.3g} > {rel:g} x {scale:.3g}"


# Tolerances relative to max(1, the reference's largest magnitude). fp32: rounding only. bf16: the
# values stay fp32 (fp32 accumulation of exact bf16 products), the gradients come back in bf16
# (and dz is rounded to bf16 before the dh/dW matmuls, as in the torch tiles).
VALUE_TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-5}
GRAD_TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
LOG_PROB_NAMES = ("log_probs", "entropy", "grad_0", "grad_1")

LOG_PROB_CASES = {
    # name: (entropy, masked, row_tau, padded, lp_grad, entropy_grad)
    "logprob-only": (False, False, False, False, True, True),
    "entropy-tau-padded": (True, False, True, True, True, True),
    "entropy-mask-tau": (True, True, True, False, True, True),
    "mask-padded-no-entropy": (False, True, False, True, True, True),
    "entropy-metric-only": (True, True, True, True, True, False),
    "entropy-grad-only": (True, False, False, True, False, True),
}


def check(got, want, names, dtype):
    assert_close(got[:2], want[:2], names[:2], VALUE_TOL[dtype])
    assert_close(got[2:], want[2:], names[2:], GRAD_TOL[dtype])


def log_prob_case_runs(case: str, dtype: torch.dtype, fused: bool, V: int, padded: int,
                      backends: tuple[str | None, ...]) -> dict[str | None, list[torch.Tensor]]:
    """:func:`log_prob_run` of the LOG_PROB_CASES row `case` on each of `backends` (None: float64)."""
    entropy, masked, row_tau, is_padded, lp_grad, entropy_grad = LOG_PROB_CASES[case]
    n_valid = padded if is_padded else V
    x = make_inputs(dtype, V=V, n_valid=n_valid)
    kwargs = dict(fused=fused, dtype=dtype, entropy=entropy, masked=masked, row_tau=row_tau, n_valid=n_valid,
                  lp_grad=lp_grad, entropy_grad=entropy_grad)
    return {backend: log_prob_run(x, backend=backend, **kwargs) for backend in backends}


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by tensors made inside the mode (each new storage counted once,
    until the tensor that brought it dies; views of the `inputs` are not new): CPU has no allocator
    statistics to read. A dispatch mode (torch's documented ``__torch_dispatch__`` hook) sees every
    aten call, those inside autograd Functions and their backward included."""

    def __init__(self, *inputs: torch.Tensor) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.seen = {t.untyped_storage().data_ptr() for t in inputs}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.seen:
                ptr, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
                self.seen.add(ptr)
                self.live += size
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, ptr, size)
        return out

    def _free(self, ptr: int, size: int) -> None:
        self.live -= size
        self.seen.discard(ptr)
