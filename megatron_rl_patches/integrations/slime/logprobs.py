"""slime's log-prob/entropy on the memory-optimal Function (patch `slime_logprobs`, declared in
`patches`): `calculate_log_probs_and_entropy` keeps slime's signature and results. It gets logits,
tokens and a group only: the invariant mode is the step's, carried by the logits
(`mode_logits`): marked where slime's step hands them over (`student_step_wrapper` on slime's
`forward_only`, the planned schedule of `slime_fused`), resolved once from the student's model config."""
# lazy imports: import cost: torch only inside the functions (tests/integrations/slime/test_slime_adapter.py)
import numbers

from megatron_rl_patches._log import warn_once
from megatron_rl_patches.integrations.step_mode import student_invariant
from megatron_rl_patches.model.arguments import adapter_arguments, bind


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
    The invariant mode: the one the logits carry (their step's: the student's model config, or the
    setting), else the setting (logits handed over by no patched step).
    """
    import torch.distributed as dist

    from megatron_rl_patches.integrations.mode_logits import mode_of, plain
    from megatron_rl_patches.ops.logprobs import log_probs_and_entropy

    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral)):
        raise TypeError(
            f"chunk_size must be an int (rows per chunk; <= 0: no preference) or None, got "
            f"{type(chunk_size).__name__} {chunk_size!r}"
        )
    if tp_group is None and dist.is_available() and dist.is_initialized():
        tp_group = dist.group.WORLD
    invariant, logits = mode_of(logits), plain(logits)
    log_prob, entropy = log_probs_and_entropy(
        logits,
        tokens,
        tp_group=tp_group,
        with_entropy=with_entropy,
        entropy_requires_grad=with_entropy_grad,
        chunk_size=chunk_size if chunk_size is not None and chunk_size > 0 else None,
        keep_mask=log_prob_keep_mask,
        invariant=invariant,
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
    known, foreign = adapter_arguments(calculate_log_probs_and_entropy, wrapped, args, kwargs)
    if known is None:
        return wrapped(*args, **kwargs)  # slime's own error message for a bad call
    if foreign:
        warn_once(
            f"slime_logprobs: this slime passes {', '.join(foreign)}, which the replacement does not "
            "support; those calls use slime's own calculate_log_probs_and_entropy"
        )
        return wrapped(*args, **kwargs)
    return calculate_log_probs_and_entropy(**known)


def student_step_wrapper(wrapped, instance, args, kwargs):
    """wrapt wrapper for slime's `forward_only(f, args, model, ...)`: the logits handed to its
    callback `f` carry the student's invariant mode (`mode_logits`), resolved once from `model`."""
    from megatron_rl_patches.integrations.mode_logits import marking

    bound = bind(wrapped, args, kwargs)
    if bound is None or not callable(bound.arguments.get("f")):
        return wrapped(*args, **kwargs)
    bound.arguments["f"] = marking(bound.arguments["f"], student_invariant(bound.arguments.get("model")))
    return wrapped(*bound.args, **bound.kwargs)
