"""NeMo-RL's distillation over the whole vocabulary from a served teacher's hidden states.

NeMo-RL #3978 (after the pin 7ea279ab) ships the teacher's hidden states from Megatron teacher
workers to the student's; on the pin, with a served teacher, the same route is: the driver's
`ServedTeacherPolicy(full_vocabulary=True).get_topk_logits` asks the pooling server once and adds
`teacher_hidden_states` [B, S, H] to NeMo-RL's `train_data` (position s: the state that predicts
token s + 1, zeros where no loss reads), which NeMo-RL shards to the student workers with the rest
of the batch; there `WholeVocabularyDistillationLossFn` (NeMo-RL's `DistillationLossFn` interface,
its `kl_type` and `mixed_kl_weight`, the teacher's Hugging Face directory for its head) runs, on
`nemo_rl_topk_kd`'s forward step, the package's `lm_head_divergence` from the student's hidden
states and output weight and the teacher's states through its head (`TeacherHead`, this rank's
vocabulary shard at the student's tensor-parallel layout): exact over the whole vocabulary, no
[T, V] logits of either model. NeMo-RL's masking and normalization (`masked_mean` over
`token_mask`·`sample_mask`, `global_valid_toks`) and its loss wrapper are kept."""
# lazy imports: optional dependency nemo_rl
from __future__ import annotations

import os
from typing import Any

import torch

from megatron_rl_patches.integrations.nemo_rl import logprobs as fused
from megatron_rl_patches.integrations.nemo_rl import step as steps
from megatron_rl_patches.integrations.student_head import student_layout_head
from megatron_rl_patches.processors.distill import divergence_output_processor
from megatron_rl_patches.processors.heads import output_tp_group
from megatron_rl_patches.processors.output import ProcessorOutput

PATCH = "nemo_rl_topk_kd"
STATES = "teacher_hidden_states"  # the batch field the served teacher adds
KL_TYPES = ("forward", "reverse", "mixed")


class WholeVocabularyDistillationLossFn:
    """NeMo-RL's distillation loss (its `loss_type`, `input_type`, `kl_type`, `mixed_kl_weight`)
    over the whole vocabulary: KL(teacher‖student) (`forward`), KL(student‖teacher) (`reverse`) or
    `mixed_kl_weight`·forward + (1 − weight)·reverse, the teacher's distribution its
    `teacher_hidden_states` through the head of `head` (its Hugging Face directory, read on each
    student worker), both at `temperature`. Runs on `nemo_rl_topk_kd`'s step only."""

    def __init__(self, cfg: Any, head: str | os.PathLike[str], temperature: float = 1.0) -> None:
        from nemo_rl.algorithms.loss.interfaces import LossInputType, LossType  # lazy: optional dependency nemo_rl

        get = cfg.get if isinstance(cfg, dict) else lambda name, default=None: getattr(cfg, name, default)
        self.kl_type = get("kl_type", "forward")
        self.mixed_kl_weight = float(get("mixed_kl_weight", 0.5))
        self.zero_outside_topk = bool(get("zero_outside_topk", False))
        if self.kl_type not in KL_TYPES or not 0.0 <= self.mixed_kl_weight <= 1.0:
            raise ValueError(f"WholeVocabularyDistillationLossFn(cfg): kl_type must be one of {KL_TYPES} and "
                             f"mixed_kl_weight in [0, 1], got {self.kl_type!r}, {self.mixed_kl_weight}")
        if not isinstance(head, (str, os.PathLike)):
            raise TypeError(f"WholeVocabularyDistillationLossFn(head=...) is the teacher's Hugging Face directory "
                            f"(read on each student worker), got {type(head).__name__}")
        self.head = os.fspath(head)
        self.temperature = float(temperature)
        self.loss_type, self.input_type = LossType.TOKEN_LEVEL, LossInputType.DISTILLATION

    def __repr__(self) -> str:
        return (f"WholeVocabularyDistillationLossFn(kl_type={self.kl_type!r}, mixed_kl_weight={self.mixed_kl_weight}, "
                f"head={self.head!r}, temperature={self.temperature})")

    @property
    def divergence(self) -> tuple[str, float]:
        """The fused op's divergence and β (mixed_kl: β is the reverse KL's share)."""
        if self.kl_type == "mixed":
            return "mixed_kl", 1.0 - self.mixed_kl_weight
        return f"{self.kl_type}_kl", 0.5

    def __call__(self, *, data: Any, global_valid_toks: Any, per_token: torch.Tensor | None = None,
                 **_ignored: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        if per_token is None:
            raise RuntimeError("WholeVocabularyDistillationLossFn runs on the package's fused step only: apply "
                               "megatron_rl_patches' nemo_rl_topk_kd on the student workers (NeMo-RL's own loss path "
                               "hands it top-k logits, not the whole vocabulary)")
        return steps.distillation_loss(per_token, data, global_valid_toks)


def states_at(data: Any, layout: Any) -> torch.Tensor:
    """The batch's teacher hidden states at this rank's rows ([B, S, H] unpacked, [1, T/cp, H]
    packed), cut or zero-padded to the micro-batch's padded length."""
    if STATES not in data:
        raise ValueError(f"{PATCH}: WholeVocabularyDistillationLossFn needs data[{STATES!r}] [B, S, H]: build "
                         "NeMo-RL's teacher with served_teacher_policy(url, head=DIR, full_vocabulary=True)")
    states = data[STATES]
    if not isinstance(states, torch.Tensor) or states.dim() != 3 or states.shape[0] != layout.batch:
        raise ValueError(f"{PATCH}: data[{STATES!r}] must be [B, S, H] with B = {layout.batch}, got "
                         f"{getattr(states, 'shape', type(states).__name__)}")
    length = layout.seq_len
    if states.shape[1] < length:
        states = torch.cat([states, states.new_zeros(states.shape[0], length - states.shape[1], states.shape[2])], 1)
    states = states[:, :length]
    return layout.local_values(states, states.new_zeros(states.shape[-1]))


def scored_rows(data: Any, layout: Any) -> torch.Tensor:
    """[b, s] bool at this rank's rows: the positions whose next token the loss reads (token s + 1
    marked by `token_mask`); the others never meet either head."""
    mask = data["token_mask"] if "token_mask" in data else torch.ones(layout.batch, layout.seq_len)
    rows = torch.zeros(layout.batch, layout.seq_len, dtype=torch.bool, device=mask.device)
    width = min(mask.shape[1], layout.seq_len) - 1
    rows[:, :width] = mask[:, 1:width + 1].bool()
    return layout.local_values(rows, torch.zeros((), dtype=torch.bool, device=mask.device))


def divergence_processor(loss: WholeVocabularyDistillationLossFn, temperature: float, chunk_size: int | None) -> Any:
    """The student's output processor: {"divergence": [b, s]} against the context's teacher states."""
    holder: dict[str, Any] = {}

    def process(*, output_layer: Any, output_weight: Any = None, context: Any = None, **rest: Any) -> ProcessorOutput:
        weight = output_weight if output_weight is not None else output_layer.weight
        head = student_layout_head(loss.head, weight, output_tp_group(output_layer), PATCH)
        if "op" not in holder:
            name, beta = loss.divergence
            holder["op"] = divergence_output_processor(divergence=name, beta=beta, temperature=temperature,
                                                       vocab_size=head.vocab_size, chunk_size=chunk_size)
        given = {**context, "teacher_weight": head.weight}
        value = holder["op"](output_layer=output_layer, output_weight=output_weight, context=given, **rest)
        return ProcessorOutput(divergence=value)

    return process


def prepare_divergence_input(*, logits: Any, data: Any, **_ignored: Any) -> tuple[dict[str, Any], Any]:
    """A `prepare_fn` for NeMo-RL's loss wrapper: the fused step's per-token divergence."""
    return {"per_token": logits["per_token"]}, data


def run_whole_vocabulary(wrapped: Any, bound: Any, post: Any) -> Any:
    """NeMo-RL's step with the student's divergence processor and `post.loss_fn`'s loss chain."""
    loss: WholeVocabularyDistillationLossFn = post.loss_fn
    feature = steps.unservable(bound.arguments, post.cfg)
    if feature is None and post.prepare_fn is not None:
        feature = "a custom prepare_fn"
    if feature is not None:  # NeMo-RL's own path has no whole-vocabulary loss to fall back to
        raise ValueError(f"{PATCH}: WholeVocabularyDistillationLossFn cannot run with {feature}; use NeMo-RL's "
                         "DistillationLossFn (top-k) for this configuration")
    temperature = steps.temperature_of(bound.arguments)
    if temperature != loss.temperature:
        raise ValueError(f"{PATCH}: the student's step runs at temperature {temperature} but the served teacher's "
                         f"loss at {loss.temperature}: the whole-vocabulary divergence takes one temperature; build "
                         f"served_teacher_policy(..., temperature={temperature})")

    def context(layout: Any) -> dict[str, Any]:
        data = layout.microbatch.data_dict
        return {"teacher_hidden": states_at(data, layout), "row_mask": scored_rows(data, layout)}

    plan = steps.ProcessorStep(divergence_processor(loss, temperature, steps.chunk_size_of(post.cfg)), temperature,
                          bool(post.cfg["sequence_packing"]["enabled"]), context=context)

    def per_token(plan: steps.ProcessorStep, output: Any) -> dict[str, torch.Tensor]:
        layout = plan.layout
        assert layout is not None
        return {"per_token": layout.unpacked(output["divergence"], layout.seq_len - 1)}

    def loss_post_process(plan: steps.ProcessorStep, original: Any) -> Any:
        return fused.loss_function(plan, bound.arguments, prepare_divergence_input, per_token)

    return steps.run_step(wrapped, bound, plan, loss_post_process)
