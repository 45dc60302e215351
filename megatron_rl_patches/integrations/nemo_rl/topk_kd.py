"""`nemo_rl_topk_kd`: NeMo-RL's top-k distillation loss as the exact (k+1)-bucket divergence.

NeMo-RL 7ea279ab's `DistillationLossFn` (with `get_distillation_topk_logprobs_from_logits`)
renormalizes the teacher's top-k logits over its k ids; with `zero_outside_topk=False` it
renormalizes the student's logits at those ids over them too (the KL of two k-point
distributions), with `zero_outside_topk=True` it takes the student's log-probs over its whole
vocabulary and, for the reverse and mixed KL, charges the student's mass outside the k ids against
a teacher tail of log ε = −100 per token. Here both distributions have k+1 buckets: the teacher's
top-k log-probs over its whole vocabulary (from `nemo_rl_topk`) and its remaining mass, the
student's log-probs at those ids over its whole vocabulary (the fused head: no [T, V] logits)
and its remaining mass. Forward, reverse and mixed KL (NeMo-RL's `kl_type`, `mixed_kl_weight`)
are exact and >= 0; `zero_outside_topk` no longer changes the value. NeMo-RL's masking and
normalization (its `masked_mean` over `token_mask`·`sample_mask`, `global_valid_toks`) are kept.
"""
# lazy imports: optional dependency nemo_rl
from __future__ import annotations

from typing import Any

import torch

from megatron_rl_patches._log import warn_once
from megatron_rl_patches.integrations.nemo_rl import logprobs as fused
from megatron_rl_patches.integrations.nemo_rl import step as steps
from megatron_rl_patches.integrations.nemo_rl import vocab_kd
from megatron_rl_patches.model.arguments import bind
from megatron_rl_patches.ops.topk import topk_kl
from megatron_rl_patches.processors.heads import topk_output_processor

PATCH = "nemo_rl_topk_kd"
REPLACED = (
    "nemo_rl_topk_kd: NeMo-RL's DistillationLossFn (top-k renormalized over k, a student tail against "
    "log eps = -100) is replaced by the exact (k+1)-bucket KL with the teacher's and the student's tails: "
    "distillation loss values differ from NeMo-RL's; set MEGATRON_RL_PATCHES_DISABLE=nemo_rl_topk_kd to keep NeMo-RL's"
)
# the teacher's top-k log-probs must leave room for a tail: sum of probabilities at most 1 (+ rounding)
MASS_SLACK = 1e-4


def teacher_logprobs(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The teacher's top-k as float32 log-probs over its whole vocabulary, checked on valid tokens."""
    values = values.to(torch.float32)
    mass = values.exp().sum(-1)
    if bool(((mass > 1 + MASS_SLACK) & valid).any()):
        raise ValueError(
            "nemo_rl_topk_kd: data['teacher_topk_logits'] must be log-probs over the teacher's whole vocabulary "
            f"(their probabilities sum to at most 1; here up to {float(mass[valid].max()):.4f}): apply nemo_rl_topk "
            "to the teacher's get_topk_logits, or disable nemo_rl_topk_kd to keep NeMo-RL's loss on raw logits"
        )
    return values


class ExactTopkDistillation:
    """NeMo-RL's distillation loss interface (loss_type, input_type) on the (k+1)-bucket KL."""

    def __init__(self, original: Any) -> None:
        self.original = original
        self.loss_type = original.loss_type
        self.input_type = original.input_type
        self.kl_type = original.kl_type
        self.mixed_kl_weight = float(original.mixed_kl_weight)

    def per_token(self, student: torch.Tensor, student_tail: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        """[B, S−1] divergence of NeMo-RL's `kl_type` (forward: KL(teacher‖student))."""
        def kl(direction: str) -> torch.Tensor:
            return topk_kl(student, student_tail, teacher, divergence=f"{direction}_kl")

        if self.kl_type == "forward":
            return kl("forward")
        if self.kl_type == "reverse":
            return kl("reverse")
        return self.mixed_kl_weight * kl("forward") + (1.0 - self.mixed_kl_weight) * kl("reverse")

    def __call__(self, *, student_topk_logprobs: torch.Tensor, student_tail: torch.Tensor,
                 teacher_topk_logprobs: torch.Tensor, data: Any, global_valid_seqs: Any,
                 global_valid_toks: Any, **_ignored: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        per_token = self.per_token(student_topk_logprobs, student_tail, teacher_topk_logprobs)
        return steps.distillation_loss(per_token, data, global_valid_toks)


def prepare_distillation_input(*, logits: Any, data: Any, **_ignored: Any) -> tuple[dict[str, Any], Any]:
    """A `prepare_fn` for NeMo-RL's loss wrapper: the fused output's (k+1) buckets, both sides."""
    return dict(logits), data


def _buckets(plan: steps.ProcessorStep, output: Any) -> dict[str, torch.Tensor]:
    layout = plan.layout
    assert layout is not None
    data = layout.microbatch.data_dict
    length = layout.seq_len - 1
    valid = data["token_mask"][:, 1:].bool() if "token_mask" in data else torch.ones(
        layout.batch, length, dtype=torch.bool)
    teacher = teacher_logprobs(data["teacher_topk_logits"][:, :length], valid.to(data["teacher_topk_logits"].device))
    return {
        "student_topk_logprobs": layout.unpacked(output["topk_log_probs"], length),
        "student_tail": layout.unpacked(output["tail"], length),
        "teacher_topk_logprobs": teacher.to(output["tail"].device),
    }


def _teacher_ids(layout: Any) -> torch.Tensor:
    """The teacher's top-k ids at this rank's rows (a packed sequence's padding rows: ids 0..k−1)."""
    ids = layout.microbatch.data_dict["teacher_topk_indices"].to(torch.long)
    return layout.local_values(ids, torch.arange(ids.shape[-1], device=ids.device))


def forward_step_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper for `nemo_rl_topk_kd` on NeMo-RL's `forward_with_post_processing_fn`."""
    from nemo_rl.algorithms.loss.interfaces import LossInputType  # lazy: optional dependency nemo_rl
    from nemo_rl.models.megatron.train import LossPostProcessor

    bound = bind(wrapped, args, kwargs)
    post = None if bound is None else bound.arguments["post_processing_fn"]
    if not (isinstance(post, LossPostProcessor)
            and getattr(post.loss_fn, "input_type", None) == LossInputType.DISTILLATION):
        return wrapped(*args, **kwargs)
    assert bound is not None
    if isinstance(post.loss_fn, vocab_kd.WholeVocabularyDistillationLossFn):  # a served teacher's hidden states
        return vocab_kd.run_whole_vocabulary(wrapped, bound, post)
    feature = steps.unservable(bound.arguments, post.cfg)
    if feature is None and post.prepare_fn is not None:
        feature = "a custom prepare_fn"
    if feature is not None:
        steps.fall_back(PATCH, feature)
        return wrapped(*args, **kwargs)
    warn_once(REPLACED)
    temperature = steps.temperature_of(bound.arguments)
    processor = topk_output_processor(temperature=temperature, chunk_size=steps.chunk_size_of(post.cfg))
    plan = steps.ProcessorStep(processor, temperature,
                          bool(post.cfg["sequence_packing"]["enabled"]),
                          context=lambda layout: {"ids": _teacher_ids(layout)})
    loss = ExactTopkDistillation(post.loss_fn)

    def loss_post_process(plan: steps.ProcessorStep, original: Any) -> Any:
        return fused.loss_function(plan, bound.arguments, prepare_distillation_input, _buckets, loss)

    return steps.run_step(wrapped, bound, plan, loss_post_process)
