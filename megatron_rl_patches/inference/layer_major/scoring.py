"""score_layer_major: every micro-batch of a rollout through transformer layer i before layer i+1
(FlexGen's block schedule), so a teacher whose weights live in host memory (residency "stream")
moves each layer's weights to the device once per rollout instead of once per micro-batch.

The model's own forward does the work: its embedding and rotary embedding once per micro-batch,
its decoder one layer at a time, its final norm, output layer or output_processor at the end
(layer_major/decoder_steps.py); results equal `chunk(**batch, output_processor=...)` bit for bit.
"""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from megatron_rl_patches.inference.layer_major.activation_store import ActivationStats, ActivationStore, check_budget
from megatron_rl_patches.inference.layer_major.decoder_steps import (
    FINAL_NORM_NAMES,
    capture_decoder_call,
    finish_model_call,
    run_decoder_layer,
)
from megatron_rl_patches.inference.residency.placement import (
    hold,
    hold_if_room,
    note_activation_bytes,
    on_device,
    residency_of,
)
from megatron_rl_patches.model.chunks import has_grad_buffers, is_ddp_like, iter_wrapped, module_chunks, unwrap

# keywords score_layer_major sets itself on every call of the model
_RESERVED_KEYS = ("decoder_input", "inference_context", "inference_params", "output_processor",
                  "output_processor_context")


def _the_chunk(chunks: Any) -> torch.nn.Module:
    """The one model chunk of a pipeline-parallel-1 inference-only build; errors otherwise."""
    chunk_list = module_chunks(chunks, "chunks")
    if len(chunk_list) != 1:
        raise ValueError(
            f"score_layer_major needs pipeline parallelism 1 without virtual stages: one model chunk, got "
            f"{len(chunk_list)}; score a pipelined model per micro-batch with inference_forward"
        )
    chunk = chunk_list[0]
    if any(is_ddp_like(m) or has_grad_buffers(m) or isinstance(m, torch.nn.parallel.DistributedDataParallel)
           for m in iter_wrapped(chunk)):
        raise TypeError(
            f"chunks holds a DDP-wrapped {type(chunk).__name__}: layer-major scoring is for frozen models; "
            "build the teacher with build_inference_model (no DDP wrapper, no grad buffer)"
        )
    trainable = next((name for name, p in chunk.named_parameters() if p.requires_grad), None)
    if trainable is not None or chunk.training:
        found = f"parameter {trainable!r} requires grad" if trainable is not None else "the chunk is in train mode"
        raise TypeError(
            f"score_layer_major scores frozen models only, but {found}; build the model with "
            "build_inference_model (or call .requires_grad_(False) and .eval() on it)"
        )
    _check_pipeline_parallel_1()
    model = unwrap(chunk)
    if not (getattr(model, "pre_process", True) and getattr(model, "post_process", True)):
        raise ValueError(
            "score_layer_major needs the whole model in one chunk (pre_process and post_process both True): "
            "pipeline parallelism is not supported"
        )
    decoder, layers = getattr(model, "decoder", None), getattr(getattr(model, "decoder", None), "layers", None)
    if not isinstance(decoder, torch.nn.Module) or not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(
            f"score_layer_major supports megatron-core's GPTModel (and HybridModel on megatron-core >= 0.18): "
            f"a model with a .decoder holding .layers; got {type(model).__name__}"
        )
    if len(layers) == 0:
        raise ValueError(f"{type(model).__name__} has no decoder layers on this rank: nothing to score layer-major")
    return chunk


def _check_pipeline_parallel_1() -> None:
    try:
        from megatron.core import parallel_state

        size = parallel_state.get_pipeline_model_parallel_world_size()
    except (AssertionError, AttributeError, ImportError, RuntimeError):  # no parallel state: one stage
        return
    if size is not None and size > 1:
        raise ValueError(
            f"score_layer_major supports pipeline parallelism 1 only, this job runs {size} pipeline stages; "
            "score a pipelined model per micro-batch with inference_forward"
        )


def _check_batches(batches: Any) -> list[Mapping[str, Any]]:
    """The micro-batches as a list of keyword mappings of the same structure; errors otherwise."""
    if isinstance(batches, Mapping) or not isinstance(batches, Sequence):
        raise TypeError(
            "batches must be a list of micro-batches, each a dict of the model's forward keywords "
            f"(input_ids, position_ids, attention_mask, labels, packed_seq_params, ...), got {type(batches).__name__}"
        )
    if not batches:
        raise ValueError("batches is empty: give at least one micro-batch (a dict of the model's forward keywords)")
    first = batches[0]
    for index, batch in enumerate(batches):
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"batches[{index}] must be a dict of the model's forward keywords, got {type(batch).__name__}")
        reserved = sorted(set(batch) & set(_RESERVED_KEYS))
        if reserved:
            raise ValueError(
                f"batches[{index}] sets {reserved}: score_layer_major passes these itself (output_processor and "
                "output_processor_context as its own arguments; no decoder_input or inference context)"
            )
        if set(batch) != set(first):
            raise ValueError(
                f"batches[{index}] has keys {sorted(batch)} but batches[0] has {sorted(first)}: every micro-batch "
                "must give the same forward keywords"
            )
        for key, value in batch.items():
            if _structure(value) != _structure(first[key]):
                raise ValueError(
                    f"batches[{index}][{key!r}] is {_structure(value)} but batches[0][{key!r}] is "
                    f"{_structure(first[key])}: every micro-batch must give the same kind of value per keyword"
                )
    return list(batches)


def _structure(value: Any) -> str:
    """What must agree between micro-batches: the type, and a tensor's rank and dtype."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-d {value.dtype} tensor"
    return "None" if value is None else f"a {type(value).__name__}"


def _contexts(output_processor: Any, context: Any, count: int) -> list[Any]:
    """One output_processor_context per micro-batch (a list or tuple gives one each)."""
    if output_processor is not None and not callable(output_processor):
        raise TypeError(
            f"output_processor must be callable (e.g. log_prob_output_processor()), got {output_processor!r}")
    if output_processor is None:
        if context is not None:
            raise ValueError("output_processor_context was given without an output_processor")
        return [None] * count
    if isinstance(context, (list, tuple)):
        if len(context) != count:
            raise ValueError(
                f"output_processor_context is a list of {len(context)} contexts but there are {count} "
                "micro-batches: give one context per micro-batch, or one (not a list) for all"
            )
        return list(context)
    return [context] * count


def _check_processor_hook(model: torch.nn.Module) -> None:
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # no signature to read: let the model's forward decide
        return
    if "output_processor" not in parameters and not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        raise TypeError(
            f"{type(model).__name__}.forward has no output_processor keyword: apply the gpt_output_processor "
            "patch (GPTModel on megatron-core < 0.18) or hybrid_output_processor (HybridModel), e.g. "
            "megatron_rl_patches.apply(only=['gpt_output_processor', 'hybrid_output_processor'])"
        )


class _StageHolds:
    """The weights of each stage (embedding, layer i, head) held on the device while the stage runs
    over every micro-batch, and those of the next `lookahead` stages held already, so their copy
    overlaps this stage's compute (residency `hold`: one copy per held piece, none for resident).
    A look-ahead hold the budget has no room for now waits until its stage starts."""

    def __init__(self, stages: list[list[torch.nn.Module]], lookahead: int) -> None:
        self._stages, self._lookahead = stages, lookahead
        self._open: dict[int, list[Callable[[], object]]] = {}

    def enter(self, index: int) -> None:
        self._hold(index, required=True)
        for ahead in range(index + 1, min(index + 1 + self._lookahead, len(self._stages))):
            if not self._hold(ahead, required=False):
                break

    def _hold(self, index: int, required: bool) -> bool:
        if index in self._open:
            return True
        releases: list[Callable[[], object]] = []
        try:
            for module in self._stages[index]:
                if required:
                    held = hold(module)
                    held.__enter__()
                    releases.append(functools.partial(held.__exit__, None, None, None))
                    continue
                release = hold_if_room(module)
                if release is None:
                    for done in reversed(releases):
                        done()
                    return False
                releases.append(release)
        except BaseException:
            for done in reversed(releases):
                done()
            raise
        self._open[index] = releases
        return True

    def leave(self, index: int) -> None:
        for release in reversed(self._open.pop(index, [])):
            release()

    def close(self) -> None:
        for index in sorted(self._open, reverse=True):
            self.leave(index)


@torch.no_grad()
def score_layer_major(
    chunks: Sequence[torch.nn.Module] | torch.nn.Module,
    batches: Sequence[Mapping[str, Any]],
    *,
    output_processor: Callable[..., Any] | None = None,
    output_processor_context: Any = None,
    activation_budget: int | None = None,
    stats: ActivationStats | None = None,
) -> list[Any]:
    """The model's output for every micro-batch (`chunk(**batch, output_processor=...)`, bit for
    bit: logits, loss or the processor's dict), computed layer-major under no_grad.

    `chunks`: one frozen chunk (build_inference_model; pipeline parallelism 1). `batches`: dicts of
    the model's forward keywords, same keys and kinds of value in each. `output_processor_context`:
    one context, or a list with one per micro-batch. `activation_budget`: device bytes for the
    hidden states kept between layers (None: no limit); beyond it they wait in host memory.
    `stats` (an ActivationStats, optional) receives the activation bytes and the bytes spilled to
    host; a swap or stream build's residency_report shows the device activation bytes too.
    """
    chunk = _the_chunk(chunks)
    batch_list = _check_batches(batches)
    contexts = _contexts(output_processor, output_processor_context, len(batch_list))
    store = ActivationStore(check_budget(activation_budget),
                            on_change=functools.partial(note_activation_bytes, [chunk]))
    model = unwrap(chunk)
    if output_processor is not None:
        _check_processor_hook(model)
    decoder = model.decoder

    def model_call(index: int) -> Callable[..., Any]:
        extra = {} if output_processor is None else {
            "output_processor": output_processor, "output_processor_context": contexts[index]}
        return functools.partial(chunk, **batch_list[index], **extra)

    calls = [model_call(index) for index in range(len(batch_list))]
    owner = residency_of([chunk])  # None for a resident build: holds are no-ops, nothing to prefetch
    holds = _StageHolds(_stages(model), owner.prefetch if owner is not None else 0)
    try:
        with on_device([chunk]):  # a swap model: in once for the whole rollout
            holds.enter(0)
            decoder_calls = [capture_decoder_call(decoder, call) for call in calls]
            for index, (_, kwargs) in enumerate(decoder_calls):
                store.put(index, kwargs.pop("hidden_states"))
            holds.leave(0)
            for layer_index in range(len(decoder.layers)):
                holds.enter(layer_index + 1)
                for index, decoder_call in enumerate(decoder_calls):
                    store.put(index, run_decoder_layer(decoder, layer_index, decoder_call, store.take(index)))
                holds.leave(layer_index + 1)
            holds.enter(len(decoder.layers) + 1)
            outputs = [finish_model_call(decoder, call, store.take(index)) for index, call in enumerate(calls)]
    finally:
        holds.close()
        store.clear()
    if stats is not None:
        stats.__dict__.update(store.stats.__dict__)
    return outputs


def _stages(model: torch.nn.Module) -> list[list[torch.nn.Module]]:
    """The modules each stage runs, in order: embedding, every decoder layer, the head (final norm
    and output layer; residency's head piece includes a tied embedding weight)."""
    decoder: Any = model.decoder
    head = [getattr(decoder, name, None) for name in FINAL_NORM_NAMES] + [getattr(model, "output_layer", None)]
    stages = [[getattr(model, "embedding", None)], *([layer] for layer in decoder.layers), head]
    return [[m for m in stage if isinstance(m, torch.nn.Module)] for stage in stages]
