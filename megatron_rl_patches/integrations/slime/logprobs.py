"""slime's log-prob/entropy on the memory-optimal Function (patch `slime_logprobs`, declared in
`patches`): `calculate_log_probs_and_entropy` keeps slime's signature and results. It gets logits,
tokens and a group only: the invariant mode is the step's (`step_mode`), resolved from the
student's model config by `student_step_wrapper` on slime's callers that hold the model."""
# lazy imports: import cost: torch only inside the functions (tests/integrations/slime/test_slime_adapter.py)
import inspect
import numbers

from megatron_rl_patches._args import bind
from megatron_rl_patches._log import warn_once
from megatron_rl_patches.integrations.step_mode import run_in_student_mode, step_invariant


def calculate_log_probs_and_entropy(
    logits,
    tokens,
    tp_group,
    with_entropy: bool = False,
    chunk_size: int = -1,
    log_prob_keep_mask=None,
    with_entropy_grad: bool = True,
):
    """slime's ``calculate_log_probs_and_entropy`` (same signature and results) on the memory-optimal Function.

    slime semantics kept: ``tp_group=None`` with torch.distributed initialized means the default
    group; log-probs come back as ``[T, 1]`` (``(0,)`` when T = 0); entropy ``[T]`` or None;
    ``chunk_size <= 0`` means no chunking preference; padded vocab columns are scored as slime does.
    The invariant mode: the slime step's (the student's model config), else the setting.
    """
    import torch.distributed as dist

    from megatron_rl_patches.ops.logprobs import log_probs_and_entropy

    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral)):
        raise TypeError(
            f"chunk_size must be an int (rows per chunk; <= 0: no preference) or None, got "
            f"{type(chunk_size).__name__} {chunk_size!r}"
        )
    if tp_group is None and dist.is_available() and dist.is_initialized():
        tp_group = dist.group.WORLD
    log_prob, entropy = log_probs_and_entropy(
        logits,
        tokens,
        tp_group=tp_group,
        with_entropy=with_entropy,
        entropy_requires_grad=with_entropy_grad,
        chunk_size=chunk_size if chunk_size is not None and chunk_size > 0 else None,
        keep_mask=log_prob_keep_mask,
        invariant=step_invariant(),
    )
    if logits.size(0) != 0:
        log_prob = log_prob.unsqueeze(-1)
    return log_prob, entropy


def calculate_log_probs_and_entropy_wrapper(wrapped, instance, args, kwargs):
    """wrapt wrapper for ``slime_logprobs``: calls the adapter instead of slime's function.

    Arguments are bound to the installed slime function's own signature (forks order and name
    them differently), with its defaults. A call that gives a parameter the adapter does not know
    a non-default value goes to slime's original, with one warning, rather than being
    misread or failing the training step.
    """
    known = inspect.signature(calculate_log_probs_and_entropy).parameters
    signature = inspect.signature(wrapped)
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in signature.parameters.values()):
        signature = inspect.signature(calculate_log_probs_and_entropy)  # slime's documented one
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return wrapped(*args, **kwargs)  # slime's own error message for a bad call
    bound.apply_defaults()
    foreign = [
        name
        for name, value in bound.arguments.items()
        if name not in known and value is not signature.parameters[name].default
    ]
    if foreign:
        warn_once(
            f"slime_logprobs: this slime passes {', '.join(foreign)}, which the replacement does not "
            "support; those calls use slime's own calculate_log_probs_and_entropy"
        )
        return wrapped(*args, **kwargs)
    return calculate_log_probs_and_entropy(**{k: v for k, v in bound.arguments.items() if k in known})


def student_step_wrapper(wrapped, instance, args, kwargs):
    """wrapt wrapper for slime's callers that hold the student (`forward_only` / `train_one_step`:
    their `model`; the actor's `train_actor`: its own): the calls inside run in the student's
    invariant mode (`step_mode.student_mode`; an enclosing step's mode is kept)."""
    bound = bind(wrapped, args, kwargs)
    model = bound.arguments.get("model") if bound is not None else None
    if model is None:
        model = getattr(instance, "model", None)
    if model is None:
        return wrapped(*args, **kwargs)
    return run_in_student_mode(model, wrapped, args, kwargs)
