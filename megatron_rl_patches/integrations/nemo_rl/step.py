"""One NeMo-RL forward step on an output processor: what the three NeMo-RL records share.

NeMo-RL's `megatron_forward_backward` hands Megatron's schedule `forward_with_post_processing_fn`
(looked up at call time in train.py). A record's wrapper decides per step whether it serves the
step's post-processor; if so it calls NeMo-RL's own step with the micro-batch iterator noted (the
`ProcessedMicrobatch` the step takes) and a model whose call adds `labels=`, `output_processor=`
and `output_processor_context=` (megatron-core >= 0.18's GPTModel hook; `gpt_output_processor`
before), so the last pipeline stage returns the processor's dict (`FusedOutput`) instead of
logits; it then replaces the post-processing function NeMo-RL built with its own, which reads
that dict. What a record cannot serve goes to NeMo-RL's own path with one log line naming it.
"""
# lazy imports: optional dependency nemo_rl
from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

from megatron_rl_patches._log import warn_once
from megatron_rl_patches.integrations.nemo_rl.rows import Layout

FALLBACK = "{patch}: {feature}: this step uses NeMo-RL's own logits path"


def fall_back(patch: str, feature: str) -> None:
    """One log line per patch, feature and process, on the rank that falls back."""
    warn_once(FALLBACK.format(patch=patch, feature=feature), every_rank=True)


class FusedOutput(dict):
    """The processor's dict, standing where NeMo-RL expects logits. NeMo-RL divides logits by the
    temperature in place (`apply_temperature_scaling`); the processor already ran at it, so
    `div_` checks the value and changes nothing."""

    def __init__(self, values: dict, temperature: float) -> None:
        super().__init__(values)
        self.temperature = temperature

    def div_(self, value: Any) -> FusedOutput:
        if float(value) != self.temperature:
            raise ValueError(f"NeMo-RL scaled the fused output by {value}, but it was computed at temperature "
                             f"{self.temperature}")
        return self


class NotingIterator:
    """The step's micro-batch iterator; keeps the micro-batch last taken."""

    def __init__(self, source: Iterator[Any]) -> None:
        self.source = source
        self.last: Any = None

    def __iter__(self) -> NotingIterator:
        return self

    def __next__(self) -> Any:
        self.last = next(self.source)
        return self.last


class ProcessorModel:
    """The step's model, its call given `labels=` and an output processor for the noted micro-batch."""

    def __init__(self, model: Any, plan: ProcessorStep, batches: NotingIterator) -> None:
        self.model, self.plan, self.batches = model, plan, batches

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        layout = Layout(self.batches.last, self.plan.packed)
        self.plan.layout = layout
        kwargs.pop("fp32_output", None)  # the processor's outputs are float32 already
        output = self.model(*args, **kwargs, labels=layout.local_targets(), output_processor=self.plan.processor,
                            output_processor_context=self.plan.context(layout))
        return FusedOutput(output, self.plan.temperature) if isinstance(output, dict) else output


class ProcessorStep:
    """What one served step runs: the processor, its context, and the layout once the model ran."""

    def __init__(self, processor: Callable[..., Any], temperature: float, packed: bool,
                 context: Callable[[Layout], Any] = lambda layout: None) -> None:
        self.processor, self.temperature, self.packed, self.context = processor, temperature, packed, context
        self.layout: Layout | None = None


def unservable(arguments: dict, cfg: Any) -> str | None:
    """The feature of this step the fused route cannot serve, or None."""
    from nemo_rl.algorithms.logits_sampling_utils import (
        need_top_k_or_top_p_filtering,  # lazy: optional dependency nemo_rl
    )

    packed = bool(cfg["sequence_packing"]["enabled"])
    checks = (
        (need_top_k_or_top_p_filtering(arguments.get("sampling_params")), "top-k / top-p sampling"),
        (bool(arguments.get("use_fused_linear_logprobs")), "use_fused_linear_logprobs (NeMo-RL's own fused head)"),
        (arguments.get("draft_model") is not None or bool(arguments.get("enable_hidden_capture")),
         "a draft model (hidden-state capture)"),
        (bool(arguments.get("use_router_replay")), "router replay"),
        (not packed and _cp_size() > 1, "context parallelism without sequence packing"),
    )
    return next((feature for failed, feature in checks if failed), None)


def _cp_size() -> int:
    from megatron.core import parallel_state  # lazy: optional dependency megatron-core

    return parallel_state.get_context_parallel_world_size()


def chunk_size_of(cfg: Any) -> int | None:
    """NeMo-RL's `logprob_chunk_size` (rows per chunk of its logits), as the fused ops' rows per tile."""
    value = cfg.get("logprob_chunk_size") if hasattr(cfg, "get") else None
    return None if value is None else int(value)


def temperature_of(arguments: dict) -> float:
    params = arguments.get("sampling_params")
    return 1.0 if params is None else float(params.temperature)


def run_step(wrapped: Any, bound: inspect.BoundArguments, plan: ProcessorStep,
             post_process: Callable[[Any, Any], Callable[[Any], Any]]) -> Any:
    """NeMo-RL's step with the noted iterator and the processor model; its post-processing
    function replaced by `post_process(plan, nemo_rl_function)`'s."""
    batches = NotingIterator(bound.arguments["data_iterator"])
    bound.arguments["data_iterator"] = batches
    bound.arguments["model"] = ProcessorModel(bound.arguments["model"], plan, batches)
    output, function = wrapped(*bound.args, **bound.kwargs)
    if not isinstance(output, FusedOutput):
        return output, function  # an earlier pipeline stage: hidden states go on to the next
    return output, post_process(plan, function)


def distillation_loss(per_token: Any, data: Any, global_valid_toks: Any) -> tuple[Any, dict[str, Any]]:
    """NeMo-RL's `DistillationLossFn` reduction of a per-token divergence [B, S−1]: `masked_mean`
    over `token_mask`·`sample_mask` with `global_valid_toks`, and its metrics."""
    from nemo_rl.algorithms.utils import masked_mean  # lazy: optional dependency nemo_rl

    if "token_mask" in data and "sample_mask" in data:
        mask = data["token_mask"][:, 1:][:, :per_token.shape[1]] * data["sample_mask"].unsqueeze(-1)
        loss = masked_mean(per_token, mask, global_normalization_factor=global_valid_toks)
    else:
        loss = per_token.mean()
    return loss, {"loss": float(loss.item()) if loss.ndim == 0 else loss,
                  "num_valid_samples": data["input_ids"].shape[0]}
