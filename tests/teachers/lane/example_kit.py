"""What the served-teacher example's tests recompute in float64 (examples/served_teacher_loop.py):
the student's whole log-softmax rows of a step and the (k+1)-bucket forward KL against a teacher's
buckets."""
from __future__ import annotations

import torch


def bucket_kl(student_rows: torch.Tensor, ids: torch.Tensor, teacher_logp: torch.Tensor,
              teacher_tail: torch.Tensor) -> torch.Tensor:
    """Float64 forward KL over the k + 1 buckets per row: the student's full log-softmax rows at the
    teacher's ids, the tail its exact complement; the teacher's values as given."""
    p = student_rows.gather(1, ids).exp()
    p = torch.cat([p, 1 - p.sum(1, keepdim=True)], dim=1)
    q = torch.cat([teacher_logp.exp(), teacher_tail.exp()[:, None]], dim=1)
    return (q * (q.log() - p.log())).sum(1)


def student_log_softmax(inputs) -> torch.Tensor:
    """[b, s, V] float64: the step's student logits gathered over the tensor-parallel ranks (the
    example's `StepInputs`), log-softmaxed over the real vocabulary."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from served_teacher_loop import student_forward

    group = parallel_state.get_tensor_model_parallel_group()
    with torch.no_grad():
        logits = student_forward(inputs.student, inputs.tokens)  # [b, s, V_padded / tp]
        parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, logits.contiguous(), group=group)
    return torch.log_softmax(torch.cat(parts, dim=-1)[..., :inputs.vocab_size].double(), dim=-1)


def teacher_log_softmax(states: torch.Tensor, weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, V] float64: a served teacher's states [R, H_t] through its head (this rank's shard
    `weight`, gathered over the tensor-parallel ranks), log-softmaxed over the real vocabulary."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(weight) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, weight.contiguous(), group=group)
    whole = torch.cat(parts)[:vocab_size].double()
    return torch.log_softmax(states.double() @ whole.T, dim=-1)
