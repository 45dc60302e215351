"""verl's live self-teacher: MEGATRON_RL_PATCHES_VERL_TEACHER=`student;context=KEY`.

verl scores its teachers in the agent loop, away from the student's weights; this teacher runs on
the trainer instead, inside verl's Megatron engine `forward_step` (`topk.forward_step_wrapper`),
on each top-k distillation micro-batch (`distillation_use_topk`, verl's logits-processor route):

- each sample's privileged context is the micro-batch's non-tensor field KEY (ids, or text through
  the tokenizer `;tokenizer=DIR` names), followed by the sample's response ids (`with_context`;
  the response starts where verl's loss mask does, `vocab.response_starts`);
- a pass of the same model chunk over those privileged sequences under `torch.no_grad()` (the
  student's own weights, as below: no copy, no server, no weight sync; no gradient flows through
  the teacher's side), its output layer replaced by `hidden_output_processor` (GPTModel's
  `output_processor=`: megatron-core >= 0.18, or the package's `gpt_output_processor` patch), hands
  `teachers.SelfTeacher` the response rows' hidden states and the output weight: the top-k of the
  student's whole distribution at temperature 1 (as verl's own teacher rows) from the fused head,
  vocab-parallel at tensor parallelism, never the privileged sequences' [R, V] logits;
- those rows replace the micro-batch's `teacher_ids` / `teacher_logprobs` (in a copy: verl's
  batch untouched), laid out as verl's agent loop lays them (row r predicts token r + 1, the
  prompt's rows and the last row zeros), and verl's top-k loss (`verl_topk_kd`'s exact (k+1)-bucket
  KL: the tail is the rest of the teacher's mass) reads them.

The weights: those the step's old log-probs come from. verl's actor `compute_log_prob` (the
old-log-prob pass: `infer_batch`, no loss, no grad, `calculate_entropy=True`; its reference pass
asks for no entropy and is left alone) runs the same engine `forward_step` over the rollout's
micro-batches before the update; there each micro-batch carrying the context field and the agent
loop's placeholder rows is scored (`remember_old_rows`) and its rows kept on the CPU by the
privileged sequence's content (`old_rows`: one pass's rows, held by the engine, forgotten when the
next pass starts). The update's distillation micro-batches read them back, so every mini-batch and
PPO epoch of the rollout is taught by the weights before its first optimizer step. Where a sample has no kept rows
on some tensor-parallel rank (verl took its old log-probs from the rollout, `bypass_mode`, so no
pass ran; a sample verl moved to another data-parallel rank), the micro-batch is scored in the
update, by the weights that update step starts from (equal on a rollout's first mini-batch).

K: the micro-batch's placeholder `teacher_ids` width (the agent loop's rows,
`self_entry.placeholder_rows`), else the loss's `distillation_config.distillation_loss.topk`.
Pipeline and context parallelism and verl's fused route (`use_fused_kernels`: no logits processor
reads the rows there) are refused by name (the pass runs one whole model chunk over whole
sequences). Every refusal, and whether every rank holds a micro-batch's kept rows, is agreed over the
tensor-parallel group before the pass's first collective."""
from __future__ import annotations

from typing import Any

import torch

from megatron_rl_patches.integrations.context_fields import privileged_batch, tokenizer_vocab
from megatron_rl_patches.integrations.verl.old_rows import old_rows_of, sample_key
from megatron_rl_patches.integrations.verl.self_entry import WHO
from megatron_rl_patches.integrations.verl.vocab import output_weight, response_starts
from megatron_rl_patches.integrations.verl.vocab_context import field_values
from megatron_rl_patches.model.chunks import unwrap
from megatron_rl_patches.ops.scoring_plan import ScoringPlan
from megatron_rl_patches.processors.distill import hidden_output_processor
from megatron_rl_patches.processors.heads import output_tp_group
from megatron_rl_patches.teachers.agreement import agreed_views
from megatron_rl_patches.teachers.batch import TeacherBatch
from megatron_rl_patches.teachers.self_teacher import SelfTeacher, StudentHidden


def topk_width(batch: Any, loss_function: Any) -> int:
    """K: the placeholder rows' width, else the loss's distillation config (verl binds it with partial)."""
    ids = batch.get("teacher_ids", None) if "teacher_ids" in batch.keys() else None
    if isinstance(ids, torch.Tensor) and ids.dim() >= 2:
        return int(ids.values().shape[-1] if ids.is_nested else ids.shape[-1])
    config = (getattr(loss_function, "keywords", None) or {}).get("distillation_config")
    k = getattr(getattr(config, "distillation_loss", None), "topk", None)
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"{WHO}: the micro-batch has no teacher_ids to take K from and the loss names no "
                         "distillation_config.distillation_loss.topk: configure verl's top-k distillation (use_topk, "
                         "topk=K)")
    return k


def check_layout(core: Any, batch: Any, instance: Any) -> None:
    from megatron.core import parallel_state  # lazy: optional dependency megatron-core
    from verl.utils import tensordict_utils as tu  # lazy: optional dependency verl

    fused = getattr(getattr(instance, "engine_config", None), "use_fused_kernels", False)
    if tu.get_non_tensor_data(batch, "use_fused_kernels", fused):
        raise ValueError(f"{WHO}: verl's fused route (use_fused_kernels) has no logits processor for the top-k loss "
                         "to read the teacher's rows in; run the live self-teacher with use_fused_kernels=False")
    if not (getattr(core, "pre_process", True) and getattr(core, "post_process", True)):
        raise ValueError(f"{WHO}: pipeline parallelism is not hosted (the no-grad pass runs one whole model chunk); "
                         "run the live self-teacher at pipeline-parallel size 1, or serve a copy of the student")
    if parallel_state.get_context_parallel_world_size() > 1 or tu.get_non_tensor_data(batch, "local_cp_size", None):
        raise ValueError(f"{WHO}: context parallelism is not hosted (the no-grad pass runs whole sequences); run it "
                         "without context parallelism")


def student_vocab(instance: Any, core: Any) -> int:
    """The student's real vocabulary: its Hugging Face config's where verl has one, else the output layer's."""
    padded = int(core.vocab_size)
    real = getattr(getattr(getattr(instance, "model_config", None), "hf_config", None), "vocab_size", None)
    return int(real) if isinstance(real, int) and 0 < real <= padded else padded


def self_batch(batch: Any, key: str, tokenizer: str | None, vocab: int) -> TeacherBatch:
    """The teacher's batch of the micro-batch: each sample's context under `key`, then its response."""
    values = field_values(batch, key)
    if values is None:
        fields = sorted(k for k in batch.keys() if not isinstance(batch.get(k), torch.Tensor))
        raise ValueError(f"{WHO}: the micro-batch has no non-tensor field {key!r} (context={key!r}; its non-tensor "
                         f"fields are {fields}): put each sample's privileged context in that field of verl's batch")
    student_side = TeacherBatch([s.detach().cpu().long() for s in batch["input_ids"].unbind()], response_starts(batch))
    own = min(vocab, tokenizer_vocab(tokenizer) or vocab)  # the student's ids, in its tokenizer's
    return privileged_batch(student_side, values, key, WHO, tokenizer, own)


def student_pass(model: Any, sequence_parallel: int) -> Any:
    """The `StudentPass` of verl's model chunk: each privileged sequence alone, causal, padded at its
    end to a multiple of `sequence_parallel` (rows after the sequence change none before it), in eval
    mode (the chunk's mode restored after), its output layer replaced by `hidden_output_processor`
    (the final hidden states, sequence parallelism gathered: no logits); the hidden states of its
    response rows and the output weight (this rank's vocabulary shard)."""
    device = next(model.parameters()).device
    weight = output_weight(unwrap(model))

    def run(privileged: TeacherBatch) -> StudentHidden:
        out = []
        training = model.training
        model.eval()  # a teacher's pass: no dropout, whatever the student's update configures
        try:
            for sequence, start in zip(privileged.sequences, privileged.response_starts):
                n = len(sequence)
                width = -(-n // sequence_parallel) * sequence_parallel
                ids = torch.zeros(1, width, dtype=torch.long, device=device)
                ids[0, :n] = sequence.to(device)
                causal = torch.ones(width, width, dtype=torch.bool, device=device).tril().logical_not()[None, None]
                hidden = model(ids, torch.arange(width, device=device)[None], causal,
                               output_processor=hidden_output_processor())
                # Float16Module hands a float32 copy back: the weight's own dtype again (exact)
                out.append(hidden[0, start - 1:n - 1].to(weight.dtype))
        finally:
            model.train(training)
        return StudentHidden(out, weight)

    return run


def verl_teacher_rows(rows: list[tuple[torch.Tensor, torch.Tensor]], lengths: list[int], starts: list[int],
                      k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Nested [b, L_i, k] ids (int32) and log-probs (float32) in verl's layout: sample i's response
    rows (`rows[i]`: its top-k ids and log-probs) from row starts[i] − 1, zeros elsewhere."""
    ids, log_probs = [], []
    for (top, values), length, start in zip(rows, lengths, starts):
        rows_ids = torch.zeros(length, k, dtype=torch.int32)
        laid = torch.zeros(length, k)
        rows_ids[start - 1:start - 1 + top.shape[0]] = top.to(torch.int32)
        laid[start - 1:start - 1 + values.shape[0]] = values.float()
        ids.append(rows_ids)
        log_probs.append(laid)
    return (torch.nested.nested_tensor(ids, layout=torch.jagged),
            torch.nested.nested_tensor(log_probs, layout=torch.jagged))


def scored_rows(model: Any, core: Any, group: Any, vocab: int, plan: ScoringPlan, key: str,
                privileged: TeacherBatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per privileged sequence, the self-teacher's top-k ids and log-probs of its response rows at
    `plan` (verl's K at temperature 1), from a no-grad pass of `model` now (every rank of `group`
    calls it)."""
    shards = 1 if group is None else torch.distributed.get_world_size(group)
    sequence_parallel = shards if getattr(core.config, "sequence_parallel", False) else 1
    teacher = SelfTeacher(student_pass(model, sequence_parallel), vocab, context=key, plan=plan,
                          tp_group=group, padded_vocab_size=int(output_weight(core).shape[0]) * shards)
    scores = teacher.score(privileged)
    return [(scores.topk_ids[i], scores.topk_log_probs[i]) for i in range(len(privileged.sequences))]


def sample_keys(privileged: TeacherBatch, k: int) -> list[bytes]:
    return [sample_key(sequence, start, k) for sequence, start in zip(privileged.sequences, privileged.response_starts)]


def remember_old_rows(batch: Any, model: Any, instance: Any, named: tuple[str, str | None]) -> None:
    """In verl's old-log-prob pass: score the micro-batch's privileged sequences with the weights
    the step's old log-probs come from and keep their rows on verl's engine (`old_rows_of`) for the update.
    A micro-batch without the context field or the agent loop's placeholder rows is not scored
    (its update scores it then); the decision and any refusal agreed over the tensor-parallel group."""
    key, tokenizer = named
    core = unwrap(model)
    group = output_tp_group(core.output_layer)
    error: Exception | None = None
    privileged = None
    k = vocab = 0
    try:
        if "teacher_ids" in batch.keys() and field_values(batch, key) is not None:
            check_layout(core, batch, instance)
            vocab = student_vocab(instance, core)
            k = topk_width(batch, None)
            privileged = self_batch(batch, key, tokenizer, vocab)
    except (TypeError, ValueError) as refused:
        error = refused
    scoring = agreed_views(error, group, privileged is not None, own=True)
    if privileged is None or not all(scoring):
        return
    rows_of = scored_rows(model, core, group, vocab, ScoringPlan(k), key, privileged)  # verl's K: the plan at its door
    for sample, rows in zip(sample_keys(privileged, k), rows_of):
        old_rows_of(instance).put(sample, *rows)


def self_taught(batch: Any, model: Any, instance: Any, loss_function: Any, named: tuple[str, str | None]) -> Any:
    """A copy of the micro-batch whose `teacher_ids` / `teacher_logprobs` are the live
    self-teacher's on the privileged sequences: the old-log-prob pass's rows where every sample
    of the micro-batch has them on every tensor-parallel rank, else scored now (the module's note)."""
    key, tokenizer = named
    core = unwrap(model)
    group = output_tp_group(core.output_layer)
    error: Exception | None = None
    privileged = None
    cached = None
    k = vocab = 0
    try:
        check_layout(core, batch, instance)
        vocab = student_vocab(instance, core)
        k = topk_width(batch, loss_function)
        privileged = self_batch(batch, key, tokenizer, vocab)
        cached = old_rows_of(instance).get(sample_keys(privileged, k))
    except (TypeError, ValueError) as refused:
        error = refused
    # every rank's refusal, and whether every rank has the old rows, before the pass's first collective
    everywhere = all(agreed_views(error, group, cached is not None, own=True))
    assert privileged is not None
    rows = cached if cached is not None and everywhere else scored_rows(model, core, group, vocab, ScoringPlan(k), key,
                                                                        privileged)
    ids = batch["input_ids"]
    lengths = [int(n) for n in ids.offsets().diff().tolist()]
    teacher_ids, teacher_log_probs = verl_teacher_rows(rows, lengths, response_starts(batch), k)
    device = ids.device
    marked = batch.copy()
    marked["teacher_ids"] = teacher_ids.to(device)
    marked["teacher_logprobs"] = teacher_log_probs.to(device)
    return marked
