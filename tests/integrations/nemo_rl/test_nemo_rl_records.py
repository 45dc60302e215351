"""The NeMo-RL records and the exact top-k distillation math, without NeMo-RL's source (its lane,
`make test-nemo`, runs them on NeMo-RL's real code)."""
from __future__ import annotations

import math
import types

import pytest
import torch

from megatron_rl_patches import integrations
from megatron_rl_patches.integrations.nemo_rl.patches import DRIVER, PATCHES, STEP
from megatron_rl_patches.integrations.nemo_rl.topk_kd import (
    MASS_SLACK,
    ExactTopkDistillation,
    teacher_logprobs,
)

NAMES = ("nemo_rl_fused_logprobs", "nemo_rl_topk", "nemo_rl_topk_kd", "nemo_rl_shared_prefix")


def test_records_on_nemo_rls_forward_step_and_driver_selected_by_all_and_by_name():
    assert [(p.name, p.target) for p in PATCHES] == [*((name, STEP) for name in NAMES[:3]),
                                                     ("nemo_rl_shared_prefix", DRIVER), ("nemo_rl_shared_prefix", STEP)]
    registry = integrations.default_registry()
    assert [n for n in registry.patch_names() if n.startswith("nemo_rl")] == list(NAMES)
    here = "megatron_rl_patches.integrations.nemo_rl"
    assert [p.wrapper for p in PATCHES] == [
        *(f"{here}.{m}:forward_step_wrapper" for m in ("logprobs", "topk", "topk_kd")),
        f"{here}.shared_prefix:forward_backward_wrapper", f"{here}.shared_prefix:forward_step_wrapper"]


def test_shared_prefix_names_what_of_nemo_rls_call_it_does_not_plan_and_finds_its_pass_under_a_noting_iterator():
    from megatron_rl_patches.integrations.megatron.shared_prefix_pass import PrefixPass
    from megatron_rl_patches.integrations.nemo_rl.shared_prefix import PassIterator, call_layout, carried_pass
    from megatron_rl_patches.integrations.nemo_rl.step import NotingIterator
    from megatron_rl_patches.integrations.shared_prefix_doors.decision import pass_verdict

    def verdict(arguments: dict, pipeline: int = 1) -> str:
        return "; ".join(reason.said() for reason in pass_verdict("nemo-rl", call_layout(arguments, pipeline)))

    packed = types.SimpleNamespace(cfg={"sequence_packing": {"enabled": True}})
    assert verdict({"post_processing_fn": packed}) == ""
    unpacked = types.SimpleNamespace(cfg={"sequence_packing": {"enabled": False}})
    assert "sequence packing is off" in verdict({"post_processing_fn": unpacked})
    assert "policy.sequence_packing.enabled=true" in verdict({"post_processing_fn": unpacked})
    for argument, name, change in (("use_router_replay", "replayed", "policy.router_replay.enabled=false"),
                                   ("enable_hidden_capture", "draft model", "policy.draft.enabled=false"),
                                   ("use_fused_linear_logprobs", "use_fused_linear_logprobs",
                                    "policy.megatron_cfg.use_fused_linear_logprobs=false")):
        said = verdict({"post_processing_fn": packed, argument: True})
        assert name in said and change in said, said
    assert "pads every packed micro-batch to one length" in verdict({"post_processing_fn": packed}, pipeline=2)
    prefix = PrefixPass("a pass")
    carrier = PassIterator(iter([1, 2]), prefix)
    noted = NotingIterator(carrier)
    assert carried_pass(noted) is prefix and carried_pass(carrier) is prefix and carried_pass(iter([])) is None
    assert list(noted) == [1, 2] and noted.last == 2


def _float64(student, teacher, kl_type, weight=0.3):
    p, q = student.double(), teacher.double()
    p = torch.cat([p, torch.log1p(-p.exp().sum(-1, keepdim=True))], -1)
    q = torch.cat([q, torch.log1p(-q.exp().sum(-1, keepdim=True))], -1)
    forward, reverse = (q.exp() * (q - p)).sum(-1), (p.exp() * (p - q)).sum(-1)
    return {"forward": forward, "reverse": reverse}.get(kl_type, weight * forward + (1 - weight) * reverse)


@pytest.mark.parametrize("kl_type", ["forward", "reverse", "mixed"])
def test_the_exact_divergence_matches_float64_and_is_zero_at_the_teacher(kl_type):
    gen = torch.Generator().manual_seed(0)
    vocab, k = 50, 6
    teacher = torch.log_softmax(torch.randn(3, 7, vocab, generator=gen) * 2, -1).topk(k, -1)
    student_full = torch.log_softmax(torch.randn(3, 7, vocab, generator=gen) * 2, -1)
    student = student_full.gather(-1, teacher.indices)
    tail = torch.log1p(-student.exp().sum(-1))
    original = types.SimpleNamespace(loss_type="token", input_type="distillation", kl_type=kl_type,
                                     mixed_kl_weight=0.3)
    loss = ExactTopkDistillation(original)
    # NeMo-RL's loss wrapper reads the interface (loss_type, input_type) off the replacement
    assert (loss.original, loss.loss_type, loss.input_type) == (original, "token", "distillation")
    got = loss.per_token(student, tail, teacher.values)
    assert torch.allclose(got.double(), _float64(student, teacher.values, kl_type), atol=1e-6)
    assert bool((got >= 0).all())
    same = loss.per_token(teacher.values, torch.log1p(-teacher.values.exp().sum(-1)), teacher.values)
    assert float(same.abs().max()) <= 1e-6
    assert float(got.abs().max()) > 1e-3  # negative control: another student is not at 0


def test_raw_teacher_logits_are_refused_by_name_on_valid_tokens_only():
    logprobs = torch.log_softmax(torch.randn(2, 5, 30), -1).topk(4, -1).values
    valid = torch.ones(2, 5, dtype=torch.bool)
    assert teacher_logprobs(logprobs, valid).dtype == torch.float32
    raw = logprobs + 5.0  # logits: their exp sums past 1
    with pytest.raises(ValueError, match="nemo_rl_topk") as refused:
        teacher_logprobs(raw, valid)
    text = str(refused.value)
    assert text.startswith("nemo_rl_topk_kd: data['teacher_topk_logits'] must be log-probs over the teacher's whole "
                           "vocabulary (their probabilities sum to at most 1; here up to ")
    assert text.endswith("apply nemo_rl_topk to the teacher's get_topk_logits, or disable nemo_rl_topk_kd to keep "
                         "NeMo-RL's loss on raw logits")
    assert teacher_logprobs(raw, torch.zeros_like(valid)) is not None  # padding rows are not read


def test_teacher_log_probs_come_back_float32_and_a_whole_distribution_is_accepted():
    """A top-k of the whole vocabulary (mass 1 up to rounding, or just within the slack) is taken,
    in float32 (here from float64); a mass of 1.5 is refused."""
    whole = torch.log_softmax(torch.randn(2, 3, 8, dtype=torch.float64), -1)
    valid = torch.ones(2, 3, dtype=torch.bool)
    for values in (whole, whole + 0.5 * MASS_SLACK):
        assert teacher_logprobs(values, valid).dtype == torch.float32
    with pytest.raises(ValueError, match="here up to 1.5000"):
        teacher_logprobs(whole + math.log(1.5), valid)
