"""Matrix products in one fixed order, the same bits on every CPU at every thread count
(`FixedOrderGemm`): what the golden cases run the ops under.

A BLAS's sgemm (MKL here) sums a product's terms in an order that follows the CPU's code path
and the threads it splits the product over: the fused head's [6, 9] x [9, 44] logits tile had
other bits at OMP_NUM_THREADS=1 than at 2 on the same AMD EPYC. The GEMM is the BLAS's, not the
package's; what the golden files pin is the package's own arithmetic around it. Inside the block
`torch.matmul`, `torch.mm`, `torch.addmm` and the tensor methods `matmul`, `@`, `mm`, `addmm`,
`addmm_` on 2-D floating tensors are computed term by term, acc = acc + a[:, k] * b[k, :] for
k = 0..K-1 (elementwise IEEE operations: correctly rounded one element at a time), in float32 for
half-precision inputs (as torch's CPU GEMM accumulates) and rounded to the inputs' dtype once.
The other products (bmm, einsum, linear, mv, a 1-D operand, alpha or beta other than 1) raise:
an op that moves to one must be added here, never run on the BLAS unnoticed.

The functions themselves are replaced for the block (not a torch function mode: autograd runs a
custom Function's backward without the caller's modes, and the backward's products are the ones
that differed at 2 threads); nothing else may run torch in the process meanwhile."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

PRODUCTS = {(torch, "matmul"), (torch, "mm"), (torch.Tensor, "matmul"), (torch.Tensor, "__matmul__"),
            (torch.Tensor, "mm")}
ADDS = {(torch, "addmm"), (torch.Tensor, "addmm"), (torch.Tensor, "addmm_")}
REFUSED = {(torch, "bmm"), (torch, "baddbmm"), (torch, "einsum"), (torch, "mv"), (torch, "dot"), (torch, "addmv"),
           (torch.Tensor, "bmm"), (torch.Tensor, "mv"), (torch.Tensor, "dot"), (torch.Tensor, "__rmatmul__"),
           (torch.nn.functional, "linear")}
ABSENT = object()  # a name the owner inherits: deleted again at the block's end


def fixed_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N] summed over k in order, in the accumulation dtype (float32 or float64)."""
    if a.dim() != 2 or b.dim() != 2 or a.size(1) != b.size(0) or not a.is_floating_point() or a.dtype != b.dtype:
        raise NotImplementedError(f"FixedOrderGemm: a product of {a.dtype}{tuple(a.shape)} and "
                                  f"{b.dtype}{tuple(b.shape)} is no 2-D floating GEMM it fixes")
    acc_dtype = a.dtype if a.dtype in (torch.float32, torch.float64) else torch.float32
    a, b = a.detach().to(acc_dtype), b.detach().to(acc_dtype)
    acc = torch.zeros(a.size(0), b.size(1), dtype=acc_dtype, device=a.device)
    for k in range(a.size(1)):
        acc = acc + a[:, k, None] * b[None, k, :]
    return acc


class FixedOrderGemm:
    """A context manager (see the module's words); `products` counts the GEMMs it computed (the
    golden test checks the forward's and the backward's ran here)."""

    def __init__(self) -> None:
        self.products = 0
        self.saved: list[tuple[Any, str, Any]] = []

    def product(self, a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
            raise NotImplementedError("FixedOrderGemm: a product autograd records (the ops' products run without it)")
        self.products += 1
        result = fixed_product(a, b).to(a.dtype)
        return result if out is None else out.copy_(result)

    def add_product(self, in_place: bool, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
                    beta: float = 1, alpha: float = 1) -> torch.Tensor:
        if beta != 1 or alpha != 1:
            raise NotImplementedError("FixedOrderGemm: addmm with alpha or beta other than 1")
        if torch.is_grad_enabled() and (base.requires_grad or a.requires_grad or b.requires_grad):
            raise NotImplementedError("FixedOrderGemm: an addmm autograd records (the ops' products run without it)")
        self.products += 1
        acc_dtype = torch.float64 if base.dtype == torch.float64 else torch.float32
        result = (base.to(acc_dtype) + fixed_product(a, b)).to(base.dtype)
        return base.copy_(result) if in_place else result

    def __enter__(self) -> FixedOrderGemm:
        # plain functions: assigned to torch.Tensor they bind the tensor as a method does
        def product(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
            return self.product(a, b, out=out)

        def add_product(in_place: bool) -> Callable[..., torch.Tensor]:
            def add(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1,
                    alpha: float = 1) -> torch.Tensor:
                return self.add_product(in_place, base, a, b, beta=beta, alpha=alpha)
            return add

        def refused(name: str) -> Callable[..., Any]:
            def refuse(*args: Any, **kwargs: Any) -> Any:
                raise NotImplementedError(f"FixedOrderGemm: {name} is a product it does not fix (see "
                                          f"tests/kit/fixed_gemm.py): add it there")
            return refuse

        replacements: list[tuple[Any, str, Callable[..., Any]]] = []
        replacements += [(owner, name, product) for owner, name in PRODUCTS]
        replacements += [(owner, name, add_product(name == "addmm_")) for owner, name in ADDS]
        replacements += [(owner, name, refused(name)) for owner, name in REFUSED]
        for owner, name, replacement in replacements:
            self.saved.append((owner, name, owner.__dict__.get(name, ABSENT)))
            setattr(owner, name, replacement)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in reversed(self.saved):
            if original is ABSENT:  # inherited (torch.Tensor's methods live on its C base)
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self.saved.clear()
