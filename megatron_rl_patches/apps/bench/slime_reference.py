"""slime's log-prob + entropy Function, rewritten here as the benchmarks' reference: it keeps the
softmax for backward (1 U; 2 U with the entropy gradient). Imports nothing of this package, so
`bench ops` can load it beside any revision's ops."""
from __future__ import annotations

import torch


class SoftmaxKeeping(torch.autograd.Function):
    """Fused log-prob + entropy that keeps the softmax for backward, plus the logits when entropy
    has a gradient; backward reuses the softmax buffer as the gradient."""

    @staticmethod
    def forward(ctx, logits, tokens, entropy_grad):
        z = logits.float()
        m = z.amax(dim=-1, keepdim=True)
        softmax = torch.sub(z, m).exp_()
        s = softmax.sum(dim=-1, keepdim=True)
        softmax.div_(s)
        logp = (z.gather(1, tokens.unsqueeze(1)) - m - s.log()).squeeze(1)
        mean_z = torch.linalg.vecdot(softmax, z)
        entropy = m.squeeze(1) + s.log().squeeze(1) - mean_z
        ctx.entropy_grad = entropy_grad
        if entropy_grad:
            ctx.save_for_backward(softmax, tokens, logits, mean_z)
        else:
            ctx.save_for_backward(softmax, tokens)
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        softmax, tokens, *rest = ctx.saved_tensors
        extra = None
        if ctx.entropy_grad:
            logits, mean_z = rest
            extra = logits.float() - mean_z.unsqueeze(1)  # -b·p·(z - E[z]) = -b·p·(log p + H)
            extra.mul_(softmax).mul_(-grad_entropy.unsqueeze(1))
        grad = softmax.mul_(-grad_logp.unsqueeze(1))
        grad[torch.arange(grad.size(0)), tokens] += grad_logp
        if extra is not None:
            grad.add_(extra)
        return grad, None, None
