"""`slime_fused`: slime's forward steps on the package's output processors, so the last pipeline
stage returns per-token log-probs and entropy straight from the hidden states: no [1, T, V] logits.

slime (624b824a) builds its `forward_step` closures inside `forward_only` and `train_one_step`; the
records reach them through the names they look up at call time: `get_batch` (the micro-batch noted)
and `get_forward_backward_func` (a model whose call adds `labels=`, `output_processor=` and
`output_processor_context=`). slime's own helpers slice the [1, T] results (thd, zigzag, allgather
CP), so every loss keeps slime's semantics; what the route cannot serve takes slime's logits path
with one log line naming the feature."""
from __future__ import annotations

from typing import Any

from megatron_rl_patches._log import warn_once
from megatron_rl_patches.integrations.megatron.model_chunk import (
    accepts_processor,
    batch_layout,
    mtp_heads_build_logits,
    schedule_plan_unservable,
)
from megatron_rl_patches.integrations.megatron.opd.fused_context import topk_context, vocab_processor
from megatron_rl_patches.integrations.megatron.opd.hidden_teachers import real_vocab_size
from megatron_rl_patches.integrations.megatron.opd.topk_request import VocabRequest
from megatron_rl_patches.integrations.megatron.shared_prefix_pass import logged
from megatron_rl_patches.integrations.megatron.step_iterators import carried, carrying, schedule_with_step
from megatron_rl_patches.integrations.shared_prefix_doors.frameworks import SLIME
from megatron_rl_patches.integrations.shared_prefix_doors.table import feature
from megatron_rl_patches.integrations.slime import rows as slime_rows  # read at call time: tests replace them
from megatron_rl_patches.integrations.slime.fused_step import (
    FUSED_STEP,
    FusedStep,
    slime_prefix_pass,
    slime_settings,
    step_request,
)
from megatron_rl_patches.integrations.slime.top_p import kept_context, replays_top_p
from megatron_rl_patches.integrations.slime.whole_micro_batch import whole_micro_batch
from megatron_rl_patches.integrations.step_mode import student_invariant
from megatron_rl_patches.model.arguments import bind
from megatron_rl_patches.model.chunks import is_last_stage
from megatron_rl_patches.processors.combined import with_topk
from megatron_rl_patches.processors.heads import log_prob_output_processor

FALLBACK = "slime_fused: {feature}: this step uses slime's own logits path"


def fall_back(feature: str) -> None:
    """One log line per feature and process, on the rank that falls back: slime's own logits path."""
    warn_once(FALLBACK.format(feature=feature), every_rank=True)


class FusedOutput(dict):
    """The processor's dict ({"log_probs": [1, T], "entropy": [1, T] or None}) with what slime's
    loss code reads off `logits`: `.device`, `.sum()` (slime adds `0 * logits.sum()` to keep the
    graph connected) and `.dtype` (float32, so Float16Module passes it through)."""

    @property
    def device(self) -> Any:
        return self["log_probs"].device

    @property
    def dtype(self) -> Any:
        return self["log_probs"].dtype

    def sum(self) -> Any:
        return self["log_probs"].sum()


def unservable(args: Any) -> str | None:
    """The feature of slime's configuration the fused route cannot serve, or None. Routing replay
    (ENABLE_ROUTING_REPLAY=1) needs nothing of the route: slime sets its ROUTING_REPLAY_STAGE window
    around the model call, which the fused call is, and the router's patched compute_topk pops the
    recorded routes."""
    if getattr(args, "loss_type", "policy_loss") == "value_loss":
        return "the critic's value head (loss_type value_loss)"
    return None


def forward_only_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper for `forward_only(f, args, model, data_iterator, ...)`: a fused step when `f` is
    slime's log-prob callback and the configuration is servable, carried by the data iterators."""
    bound = bind(wrapped, args, kwargs)
    if bound is None or carried(bound.arguments.get("data_iterator")) is not None:  # slime's error; slime_opd's pass
        return wrapped(*args, **kwargs)
    slime_args, f = bound.arguments["args"], bound.arguments["f"]
    name = getattr(f, "__name__", type(f).__name__)
    reason = unservable(slime_args)
    if name == "get_values":
        reason = "the critic's value head (forward_only with get_values)"
    elif name != "get_log_probs_and_entropy":
        reason = f"a forward_only callback other than get_log_probs_and_entropy ({name})"
    if reason is not None:
        fall_back(reason)
        return wrapped(*args, **kwargs)
    with_entropy = bool(getattr(slime_args, "use_rollout_entropy", False))
    model = bound.arguments.get("model")
    step = FusedStep(slime_args, with_entropy, False, invariant=student_invariant(model),
                     prefix=slime_prefix_pass(slime_args, model, "slime's log-prob pass", training=False,
                                              iterators=bound.arguments.get("data_iterator"),
                                              counts=bound.arguments.get("num_microbatches"), first=0))
    return run_fused_step(step, wrapped, bound)


def train_one_step_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper for `train_one_step(args, ..., data_iterator, model, ...)`: entropy (with its
    gradient only when `entropy_coef != 0`, as slime's `with_entropy_grad`) unless the loss is
    slime's SFT loss; top-k OPD's settings as slime's `args` hold them (`slime_settings`)."""
    bound = bind(wrapped, args, kwargs)
    if bound is None:
        return wrapped(*args, **kwargs)
    slime_args = bound.arguments["args"]
    settings = slime_settings(slime_args)
    request = step_request(slime_args, settings)
    model = bound.arguments.get("model")
    invariant = student_invariant(model)
    reason = unservable(slime_args)
    if reason is not None:  # slime's logits path; a top-k loss still needs its batch keys
        fall_back(reason)
        if request is None:
            return wrapped(*args, **kwargs)
        return run_fused_step(FusedStep(slime_args, False, False, request, fused=False, invariant=invariant,
                                    settings=settings), wrapped, bound)
    with_entropy = getattr(slime_args, "loss_type", "policy_loss") != "sft_loss"
    grad = with_entropy and getattr(slime_args, "entropy_coef", 0.0) != 0
    step = FusedStep(slime_args, with_entropy, grad, request, invariant=invariant, settings=settings,
                     prefix=slime_prefix_pass(slime_args, model, "slime's training step", training=True,
                                              iterators=bound.arguments.get("data_iterator"),
                                              counts=[int(bound.arguments.get("num_microbatches") or 0)]))
    return run_fused_step(step, wrapped, bound)


def run_fused_step(step: FusedStep, wrapped: Any, bound: Any) -> Any:
    """slime's `forward_only` / `train_one_step` call (`bound` to its signature) with its data
    iterators carrying `step`."""
    bound.arguments["data_iterator"] = carrying(bound.arguments.get("data_iterator"), step)
    with logged(step.prefix):
        return wrapped(*bound.args, **bound.kwargs)


def get_batch_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper for slime's `get_batch(data_iterator, keys, ...)`: from an iterator carrying a
    fused step, the batch (with the keys a top-k request needs) is noted for the fused model call and
    carries the step (key `FUSED_STEP`) to the loss."""
    bound = bind(wrapped, args, kwargs)
    step = None if bound is None else carried(bound.arguments.get("data_iterator"))
    if bound is None or step is None:
        return wrapped(*args, **kwargs)
    index = getattr(bound.arguments.get("data_iterator"), "offset", None)  # its place in slime's schedule
    if step.topk is not None and step.topk.keys:
        keys = list(bound.arguments["keys"])
        bound.arguments["keys"] = keys + [key for key in step.topk.keys if key not in keys]
    batch = wrapped(*bound.args, **bound.kwargs)
    step.batch = batch
    if isinstance(batch, dict):
        batch[FUSED_STEP] = step
        if step.prefix is not None and batch.get("multimodal_train_inputs") is not None:
            # a vision-language prompt: its images merge into the embedding (every rank of the micro-batch alike)
            batch["packed_seq_params"] = step.prefix.packed_whole(feature("vlm").cells[SLIME].why,
                                                                  batch["packed_seq_params"])
        elif step.prefix is not None:  # the model call takes the shared-prefix plan from the batch's packed_seq_params
            whole = whole_micro_batch(batch) if step.prefix.cut is not None else None  # context parallelism
            batch["packed_seq_params"] = step.prefix.params(batch["tokens"], batch["packed_seq_params"],
                                                            len(batch["unconcat_tokens"]), whole, index)
    return batch


def schedule_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper for `get_forward_backward_func()`: the schedule it returns runs slime's
    forward step with the fused model when its data iterators carry a fused step (one for slime's
    logits path: the model whose logits carry the step's invariant mode)."""
    return schedule_with_step(wrapped(*args, **kwargs), fused_forward_step)


def fused_forward_step(step: Any, fused: FusedStep) -> Any:
    """slime's forward step, given the fused model (whose `build_schedule_plan` serves the
    combined-1F1B schedule where megatron-core's takes `output_processor`)."""

    def forward_step(data_iterator: Any, model: Any, *rest: Any, **kwargs: Any) -> Any:
        if fused.fused and (kwargs.get("return_schedule_plan") or (rest and rest[0] is True)):
            reason = schedule_plan_unservable(model)
            if reason is not None:
                fall_back(reason)
                return step(data_iterator, model, *rest, **kwargs)
        return step(data_iterator, FusedModel(model, fused), *rest, **kwargs)

    return forward_step


class FusedModel:
    """A model chunk whose call (and combined-1F1B `build_schedule_plan`) runs the log-prob output
    processor on the response rows of the noted micro-batch; every other attribute is the chunk's own.
    MTP training (slime's `mtp_kwargs`) passes through: the MTP heads' loss goes through the fused
    head (the GPT backport on megatron-core < 0.18, patch `mtp_output_processor` from 0.18 on)."""

    def __init__(self, model: Any, step: FusedStep):
        self._model, self._step = model, step

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._route(self._model, "forward", args, kwargs)

    def build_schedule_plan(self, *args: Any, **kwargs: Any) -> Any:
        """The chunk's combined-1F1B plan with the processor in its post-process node (slime's
        forward step gets this model for a plan only where `build_schedule_plan` takes
        `output_processor`: megatron-core >= 0.18)."""
        return self._route(self._model.build_schedule_plan, "build_schedule_plan", args, kwargs)

    def _route(self, plain: Any, method: str, args: tuple, kwargs: dict) -> Any:
        """`plain(*args, **kwargs)` with the processor where the micro-batch is servable; else its
        logits, carrying the step's invariant mode to slime's log-prob code (`mode_logits`)."""
        if not is_last_stage(self._model):  # its hidden states go to the next stage: the plain call
            return plain(*args, **kwargs)
        called = "model" if method == "forward" else f"model.{method}"
        if not self._step.fused:  # a step on slime's logits path
            return self._logits(plain, args, kwargs)
        batch = self._step.batch
        if args or batch is None or "input_ids" not in kwargs:
            fall_back(f"a forward step that does not call {called}(input_ids=...) after get_batch")
            return self._logits(plain, args, kwargs)
        if batch.get("multimodal_train_inputs"):
            fall_back("multimodal inputs (multimodal_train_inputs)")
            return self._logits(plain, args, kwargs)
        layout = batch_layout(kwargs.get("packed_seq_params"))
        if layout != "thd":
            if getattr(self._step.args, "allgather_cp", False):
                raise ValueError(
                    "slime_fused: --allgather-cp needs packed thd batches (slime's get_batch builds them); this "
                    f"micro-batch is {layout!r}: drop --allgather-cp or pack as thd")
            fall_back(f"{layout} batches (packed_seq_params.qkv_format != 'thd': the route slices thd packing)")
            return self._logits(plain, args, kwargs)
        if not accepts_processor(self._model, method):
            fall_back(f"a model whose {called} lacks GPTModel's output_processor keyword (apply "
                      "gpt_output_processor on megatron-core < 0.18)")
            return self._logits(plain, args, kwargs)
        if kwargs.get("mtp_kwargs") and mtp_heads_build_logits(self._model):
            warn_once(MTP_LOGITS)
        return self._fused(kwargs, batch, plain)

    def _logits(self, plain: Any, args: tuple, kwargs: dict) -> Any:
        """slime's logits path: the logits (a schedule plan: as given) marked with the step's mode."""
        from megatron_rl_patches.integrations.mode_logits import with_mode  # lazy: import cost: torch

        return with_mode(plain(*args, **kwargs), self._step.invariant)

    def _fused(self, kwargs: dict, batch: dict, call: Any) -> FusedOutput:
        step, tokens = self._step, kwargs["input_ids"]
        allgather_cp = bool(getattr(step.args, "allgather_cp", False))
        if tokens.dim() != 2 or tokens.size(0) != 1:
            raise ValueError(f"slime_fused: slime packs every micro-batch as [1, T] tokens, got {tuple(tokens.shape)}")
        length = tokens.size(1)
        labels = slime_rows.shifted_targets(batch, length, tokens.device, allgather_cp)
        rows = slime_rows.response_rows(batch, length, tokens.device, allgather_cp)
        # the step's invariant mode, the student's (a teacher's pass too); None: this model's config
        chunk = getattr(step.args, "log_probs_chunk_size", -1)
        options: dict[str, Any] = dict(temperature=float(getattr(step.args, "rollout_temperature", 1.0)),
                                       chunk_size=chunk if isinstance(chunk, int) and chunk > 0 else None,
                                       invariant=step.invariant)
        real_vocab = real_vocab_size(self._model)
        if real_vocab is not None:  # a model built from a Hugging Face checkpoint: its padding rows get no mass
            options["vocab_size"] = real_vocab
        processor = log_prob_output_processor(with_entropy=step.with_entropy,
                                              entropy_requires_grad=step.entropy_requires_grad, **options)
        context: dict = {"row_mask": rows[None]}  # the head on response rows (slime's slicing reads no other)
        if replays_top_p(step.args):  # the rollout's top-p nuclei (the rank's contiguous rows under allgather CP)
            context.update(kept_context(batch, length, tokens.device, allgather_cp) or {})

        def positions() -> list:  # top-k OPD's fields at slime's response rows
            return slime_rows.response_positions(batch, length, tokens.device, allgather_cp)

        if isinstance(step.topk, VocabRequest):  # full-vocabulary OPD: a teacher's hidden states, or the divergence
            processor = vocab_processor(step.topk, processor, options, batch, positions, length, tokens.device,
                                        allgather_cp)
        elif step.topk is not None:
            topk_ctx = topk_context(step.topk, batch, positions, length, allgather_cp)
            processor = with_topk(processor, step.topk.k, options, topk_ctx, union=step.topk.union)
        out = call(**{**kwargs, "labels": labels[None]}, output_processor=fused_output(processor),
                   output_processor_context=context)
        return out if call is not self._model else FusedOutput(out)  # a schedule plan: its node gives it


def fused_output(processor: Any) -> Any:
    """`processor` whose dict comes back as a :class:`FusedOutput` (what a combined-1F1B plan's
    post-process node hands slime's loss function)."""
    return lambda **kwargs: FusedOutput(processor(**kwargs))


MTP_LOGITS = ("slime_fused: MTP training on this megatron-core computes the MTP heads' loss in process_mtp_loss "
              "from [T, V] logits: apply patch mtp_output_processor too (it is in `all`)")


def log_probs_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper for slime's `get_log_probs_and_entropy`: a fused output is sliced per sample
    with slime's helpers; logits go to slime's function."""
    bound = bind(wrapped, args, kwargs)
    if bound is None or not isinstance(bound.arguments["logits"], FusedOutput):
        return wrapped(*args, **kwargs)
    values = bound.arguments
    key = "log_probs"
    if values.get("top_p_token_ids") is not None and values.get("top_p_token_offsets") is not None:
        key = "kept_log_probs"  # slime renormalizes over the nucleus here; entropy stays unmasked
        if key not in values["logits"]:
            raise RuntimeError("slime_fused: top-p replay reached a fused output computed without the batch's "
                               "nuclei (rollout_top_p_token_ids); please report this")
    return slime_rows.per_sample(values["logits"], values["args"], values["total_lengths"], values["response_lengths"],
                      bool(values["with_entropy"]), key)
