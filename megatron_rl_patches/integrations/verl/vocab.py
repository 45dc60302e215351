"""verl's distillation over the whole vocabulary from a served teacher's hidden states (verl #6194).

With MEGATRON_RL_PATCHES_VERL_TEACHER=`http(s)://host:port;engine=vllm;head=DIR` (a vLLM pooling
server; DIR the teacher's Hugging Face directory, readable on the trainer) and verl's fused route
(`use_fused_kernels`, with `verl_fused_logprobs`), a distillation micro-batch of verl's Megatron
engine (`distillation_use_topk`: `forward_kl_topk`) takes this route:

- the batch carries ids only: [S, H] states per sample are too big for the agent loop's batch, so
  on the last pipeline stage `forward_step` asks the pooling server itself for each sequence's
  final hidden states on the rows verl's loss reads (its response-aligned `loss_mask` after the
  prompt, `response_starts`; every tensor-parallel rank
  asks for its micro-batch, a failure agreed over the group);
- the student's side is verl's fused route: its forward runs with the output processor verl
  gives it, and beside it the package's `lm_head_divergence` from the student's hidden states
  and output weight and the teacher's states through its head (`TeacherHead`, this rank's
  vocabulary shard at the student's layout): KL(teacher‖student) over the whole vocabulary at
  verl's temperature for both, no [T, V] logits of either model and no `student_logits`;
- verl's `forward_kl_topk` loss reads the result as it reads its logits processor's:
  `distillation_losses` [b, j] (and `student_mass` = `teacher_mass` = 1: the whole distribution),
  then masks, clamps at 0 (never bites: the KL is >= 0) and aggregates as verl does.

With `;context=KEY` the teacher is privileged: the server scores each sample's non-tensor field
KEY (ids, or text through the teacher's tokenizer) followed by the sample's response
(`vocab_context`), and its states line up with the student's response rows.

What crosses the network: ids to the server, [R, H] states back (the dtype the server's model
has). Context parallelism on this route is refused by name."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_rl_patches.integrations.student_head import student_layout_head
from megatron_rl_patches.integrations.verl.entry import VerlTeacher
from megatron_rl_patches.integrations.verl.held import held
from megatron_rl_patches.integrations.verl.rows import response_lengths
from megatron_rl_patches.integrations.verl.vocab_context import agreed_privileged_batch
from megatron_rl_patches.model.chunks import is_last_stage, unwrap
from megatron_rl_patches.ops.scoring_plan import VOCAB, ScoringPlan
from megatron_rl_patches.processors.distill import divergence_output_processor
from megatron_rl_patches.processors.heads import output_tp_group
from megatron_rl_patches.settings import VERL_TEACHER
from megatron_rl_patches.teachers.batch import TeacherBatch
from megatron_rl_patches.teachers.entry import TeacherEntry

WHO = f"verl_topk_kd ({VERL_TEACHER} with head=)"


def output_weight(core: Any) -> torch.Tensor:
    """The student's output weight shard [V_local, H]: the embedding's where they are tied."""
    if getattr(core, "share_embeddings_and_output_weights", False):
        return core.shared_embedding_or_output_weight()
    return core.output_layer.weight


def response_starts(batch: Any) -> list[int]:
    """Per sequence, the first position whose token verl's loss reads: rows from start − 1 on are
    scored; the sequence's length where it reads none. In verl's trainer batch
    (`left_right_2_no_padding`) `loss_mask` is the response-aligned `response_mask` ([b, R],
    padded): the start is the prompt's length (the sequence's less the response's, as
    `no_padding_2_padding` slices it, or the engine's last R columns of `attention_mask`) plus
    the first marked response position. A nested mask as long as each sequence marks positions
    of the whole sequence. Where the batch cannot place its mask: every row after the first."""
    ids = batch["input_ids"]
    mask = batch.get("loss_mask", None)
    lengths = [int(n) for n in ids.offsets().diff().tolist()] if ids.is_nested else [ids.shape[-1]] * ids.shape[0]
    if mask is not None and mask.is_nested and [int(n) for n in mask.offsets().diff().tolist()] == lengths:
        return first_marked(mask, [0] * len(lengths), lengths, lengths)
    responses = response_lengths(batch) or mask_responses(batch, mask)
    if responses is None:
        return [1] * len(lengths)
    prompts = [length - response for length, response in zip(lengths, responses)]
    return first_marked(mask, prompts, responses, lengths)


def mask_responses(batch: Any, mask: Any) -> list[int] | None:
    """The response lengths a response-aligned `mask` implies: a nested mask's own lengths, or
    (padded [b, R]) the count of the padded `attention_mask`'s last R columns, as verl's engine
    reads its response span."""
    if mask is None:
        return None
    if mask.is_nested:
        return [int(n) for n in mask.offsets().diff().tolist()]
    attention = batch.get("attention_mask", None)
    if isinstance(attention, torch.Tensor) and not attention.is_nested:
        return [int(n) for n in attention[:, -mask.shape[-1]:].sum(dim=1).tolist()]
    return None


def first_marked(mask: Any, offsets: list[int], spans: list[int], lengths: list[int]) -> list[int]:
    """Per sequence, `offsets[i]` plus the first position of its first `spans[i]` that `mask`
    marks (every one without a mask); its length where none is."""
    starts = []
    for i, (offset, span, length) in enumerate(zip(offsets, spans, lengths)):
        marks = torch.ones(span) if mask is None else mask[i].detach().cpu()[:span]
        marked = torch.nonzero(marks).flatten()
        starts.append(max(offset + int(marked[0]), 1) if marked.numel() else length)
    return starts


def teacher_rows(engine: Any, raw: str, entry: TeacherEntry, head: Any, batch: Any,
                 group: Any) -> tuple[list[torch.Tensor], list[int]]:
    """Each sequence's served hidden states [R_i, H] (row r predicts token start_i + r) and its
    start; the teacher built once per head for verl's `engine` and held by it."""
    from megatron_rl_patches.teachers.served.build import served_teacher_of  # lazy: optional dependency httpx

    teachers: dict[tuple[str, int], Any] = held(engine, "served_teachers", dict)
    key = (raw, id(head))
    teacher = teachers.get(key)
    if teacher is None:  # the context goes into the sequences sent (`agreed_privileged_batch`), not the client
        teacher = teachers[key] = served_teacher_of(entry.without_context(), ScoringPlan(VOCAB), head=head)
    sequences = [s.detach().cpu().long() for s in batch["input_ids"].unbind()]
    starts = response_starts(batch)
    scored = TeacherBatch(sequences, starts)
    if entry.context is not None:  # context_i + response_i: the teacher's row r still predicts response token r
        scored = agreed_privileged_batch(entry, batch, scored, head.vocab_size, group)
    states = teacher.submit(scored).result(group, projected=False)
    return states, starts


def packed_rows(states: list[torch.Tensor], starts: list[int], params: Any, total: int,
                width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's states [T, H] and the scored rows [T] bool at verl's packed rows (context
    parallelism 1: sequence i at `cu_seqlens_q_padded[i]`, padding rows zeros and unscored)."""
    offsets = [int(v) for v in params.cu_seqlens_q_padded.tolist()]
    dtype = next((s.dtype for s in states if s.numel()), torch.float32)
    packed = torch.zeros(total, width, dtype=dtype)
    rows = torch.zeros(total, dtype=torch.bool)
    for sequence, (rows_i, start) in enumerate(zip(states, starts)):
        if not rows_i.shape[0]:
            continue
        first = offsets[sequence] + start - 1
        packed[first:first + rows_i.shape[0]] = rows_i.to(dtype)
        rows[first:first + rows_i.shape[0]] = True
    return packed, rows


class Distilling:
    """One fused forward of verl's model, through a forward pre-hook on it: the call verl makes
    runs verl's output processor and, on the same hidden states, the whole-vocabulary divergence
    from the teacher's packed states; the per-row values and the packing parameters are kept for
    `forward_step`."""

    def __init__(self, head: Any, states: list[torch.Tensor], starts: list[int]) -> None:
        self.head, self.states, self.starts = head, states, starts
        self.values: torch.Tensor | None = None
        self.params: Any = None

    def pre_hook(self, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        original = kwargs.get("output_processor")
        if original is None:
            raise ValueError(f"{WHO}: verl's fused forward called the model without an output processor (the "
                             "megatron-core >= 0.18 hook, or gpt_output_processor): the whole-vocabulary route "
                             "needs it")
        self.params = kwargs["packed_seq_params"]
        total = int(kwargs["input_ids"].shape[-1])
        states, rows = packed_rows(self.states, self.starts, self.params, total, self.head.hidden_size)
        return args, {**kwargs, "output_processor": self.processor(original, states, rows)}

    def processor(self, original: Callable[..., Any], states: torch.Tensor, rows: torch.Tensor) -> Callable[..., Any]:
        def process(**call: Any) -> Any:
            output = original(**call)
            hidden = call["hidden_states"]
            temperature = float(call["context"].temperature)
            divergence = divergence_output_processor(divergence="forward_kl", temperature=temperature,
                                                     vocab_size=self.head.vocab_size)
            context = {"teacher_hidden": states.to(hidden.device)[None],
                       "teacher_weight": self.head.weight, "row_mask": rows.to(hidden.device)[None]}
            self.values = divergence(hidden_states=hidden, output_layer=call["output_layer"],
                                     output_weight=call.get("output_weight"), config=call.get("config"),
                                     context=context)
            return output

        return process


def check_layout(batch: Any) -> None:
    from megatron.core import parallel_state  # lazy: optional dependency megatron-core
    from verl.utils import tensordict_utils as tu  # lazy: optional dependency verl

    if parallel_state.get_context_parallel_world_size() > 1 or tu.get_non_tensor_data(batch, "local_cp_size", None):
        raise ValueError(f"{WHO}: context parallelism is not served on the whole-vocabulary route yet; unset head= "
                         "(the top-k rows with the exact tail) or run without context parallelism")


def whole_vocabulary_step(wrapped: Callable[..., Any], instance: Any, named: VerlTeacher) -> Callable[..., Any]:
    """`MegatronEngineWithLMHead.forward_step(batch_iter, model, logits_processor_func,
    postprocess_micro_batch_func)`: a distillation micro-batch on verl's fused route with a served
    head (`named`: the variable as the engine read it) takes the whole-vocabulary route; every other
    call is verl's own."""

    def forward_step(batch_iter: Any, model: Any, *rest: Any, **options: Any) -> Any:
        entry = named.head
        if entry is None or not is_last_stage(model):
            return wrapped(batch_iter, model, *rest, **options)
        from verl.utils import tensordict_utils as tu  # lazy: optional dependency verl

        batch = next(batch_iter)
        fused = tu.get_non_tensor_data(batch, "use_fused_kernels", instance.engine_config.use_fused_kernels)
        if not (tu.get_non_tensor_data(batch, "distillation_use_topk", False) and fused):
            return wrapped(iter([batch]), model, *rest, **options)
        check_layout(batch)
        core = unwrap(model)
        weight = output_weight(core)
        group = output_tp_group(core.output_layer)
        head = student_layout_head(entry.head, weight, group, WHO)  # type: ignore[arg-type]
        states, starts = teacher_rows(instance, named.raw, entry, head, batch, group)
        distilling = Distilling(head, states, starts)
        handle = model.register_forward_pre_hook(distilling.pre_hook, with_kwargs=True)
        try:
            output, finish = wrapped(iter([batch]), model, *rest, **options)
        finally:
            handle.remove()
        if distilling.values is None:
            raise RuntimeError(f"{WHO}: verl's fused forward never reached the output processor")
        output.update(verl_outputs(distilling, batch))
        return output, finish

    return forward_step


def verl_outputs(distilling: Distilling, batch: Any) -> dict[str, torch.Tensor]:
    """What verl's `forward_kl_topk` loss reads, nested [b, j] as verl's own log-probs."""
    from verl.models.mcore.util import postprocess_thd_engine  # lazy: optional dependency verl

    values = distilling.values
    assert values is not None
    ids = batch["input_ids"]

    def unpacked(packed: torch.Tensor) -> torch.Tensor:
        return postprocess_thd_engine(packed.reshape(1, -1), distilling.params, ids, ids.shape[0], post_process=True)

    ones = torch.ones_like(values.detach())
    return {"distillation_losses": unpacked(values), "student_mass": unpacked(ones), "teacher_mass": unpacked(ones)}
