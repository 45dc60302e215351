"""Real megatron-core on CPU: a gloo world, model-parallel state, tiny GPT and HybridModel models,
DDP wrappers, batches and the real forward-backward schedule. Used by the pytest plugin and the CPU demo."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl_patches.settings import process_environment
from megatron_rl_patches.testing.model_kinds import MODEL_KINDS
from megatron_rl_patches.testing.model_kinds import ModelKindUnavailable as ModelKindUnavailable  # re-exported
from megatron_rl_patches.testing.shims import cpu_shims

TINY_VOCAB = 64
TINY_SEQ = 16


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def megatron_world(
    device: str = "cpu",
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    virtual_pipeline: int | None = None,
    seed: int = 1234,
    *,
    context_parallel: int = 1,
    expert_parallel: int = 1,
    expert_tensor_parallel: int | None = None,
) -> Iterator[MegatronCPU]:
    """A process group of world size 1 (unless one exists: gloo on "cpu" with the CPU shims, NCCL on
    "cuda") and Megatron's parallel state; on exit everything it set up is torn down. Inside a
    multi-rank world (`run_multirank`) the sizes split its ranks (TP, CP, EP, PP, the rest DP)."""
    from megatron.core import parallel_state

    cuda = device.startswith("cuda")
    created_group = False
    if not dist.is_initialized():
        rendezvous = process_environment()  # torch.distributed's env:// rendezvous reads them
        rendezvous.setdefault("MASTER_ADDR", "127.0.0.1")
        rendezvous["MASTER_PORT"] = str(_free_port())
        if cuda:
            torch.cuda.set_device(torch.device(device).index or 0)
        dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
        created_group = True
    groups_before = set(_process_groups())
    parallel_state.initialize_model_parallel(
        tensor_parallel,
        pipeline_parallel,
        virtual_pipeline_model_parallel_size=virtual_pipeline,
        context_parallel_size=context_parallel,
        expert_model_parallel_size=expert_parallel,
        expert_tensor_parallel_size=expert_tensor_parallel,
    )
    megatron_groups = [group for group in _process_groups() if group not in groups_before]  # not the block's own
    torch.manual_seed(seed)
    try:
        with contextlib.nullcontext() if cuda else cpu_shims():
            yield MegatronCPU(seed=seed)
    finally:
        parallel_state.destroy_model_parallel()
        if created_group:
            dist.destroy_process_group()
        else:  # inside a world that lives on: free the groups megatron-core made here (see _process_groups)
            alive = set(_process_groups())
            for group in reversed(megatron_groups):
                if group in alive:
                    dist.destroy_process_group(group)


def _process_groups() -> list:
    """The process groups torch holds in this process, in the order they were made. megatron-core's
    `destroy_model_parallel` drops its references but torch's registry keeps every group alive, each
    with its gloo threads (three a group): a world that made ~40 layouts in turn held ~800 threads a
    rank, and two such worlds on two cores took 610 s where each alone takes 26-44 s (megatron-core
    0.19). torch lists them only in its registry (`distributed_c10d._world.pg_map`, in creation order);
    where a release moves it, nothing is freed. Destroyed newest first, in that order on every rank:
    an NCCL whose communicator abort is collective needs the ranks to agree on it."""
    registry = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    return list(registry) if isinstance(registry, dict) else []


def megatron_on_cpu(
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    virtual_pipeline: int | None = None,
    seed: int = 1234,
    **parallel: Any,
) -> contextlib.AbstractContextManager[MegatronCPU]:
    """`megatron_world("cpu", ...)`: gloo, Megatron's parallel state and the CPU shims, torn down
    on exit so tests stay independent (keywords context_parallel, expert_parallel,
    expert_tensor_parallel as `megatron_world`)."""
    return megatron_world("cpu", tensor_parallel, pipeline_parallel, virtual_pipeline, seed, **parallel)


def tiny_gpt_config(**overrides: Any) -> Any:
    """A TransformerConfig small enough for CPU tests: 2 layers, hidden 32, no dropout, fp32."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    values: dict[str, Any] = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        pipeline_dtype=torch.float32,
    )
    values.update(overrides)
    return TransformerConfig(**values)


def _seeded_model_kwargs(
    vocab_size: int = TINY_VOCAB,
    seq_length: int = TINY_SEQ,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    seed: int | None = 0,
) -> dict[str, Any]:
    """The language-model constructor keywords shared by every kind; seeds torch when `seed` is set."""
    if seed is not None:
        torch.manual_seed(seed)
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size, max_sequence_length=seq_length, pre_process=pre_process, post_process=post_process
    )
    if vp_stage is not None:
        kwargs["vp_stage"] = vp_stage
    return kwargs


def build_tiny_gpt(config: Any = None, layer_spec: Any = None, position_embedding_type: str = "learned_absolute",
                   **kwargs: Any) -> Any:
    """A real GPTModel with `layer_spec` (default: the local, non Transformer Engine layer spec)
    and `position_embedding_type` ("learned_absolute" or "rope"). Keywords: vocab_size,
    seq_length, pre_process, post_process, vp_stage, seed (fixes the weights; default 0)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    return GPTModel(
        config=config if config is not None else tiny_gpt_config(),
        transformer_layer_spec=layer_spec if layer_spec is not None else get_gpt_layer_local_spec(),
        position_embedding_type=position_embedding_type,
        **_seeded_model_kwargs(**kwargs),
    )


def build_tiny_hybrid(config: Any = None, *, layer_pattern: str | None = None, **kwargs: Any) -> Any:
    """A real HybridModel of attention ('*') and MLP ('-') layers with local modules (other keywords as
    `build_tiny_gpt`); the pattern defaults to '*-' repeated over `config.num_layers`.
    ModelKindUnavailable before megatron-core 0.18."""
    from megatron_rl_patches.testing import tiny_hybrid  # lazy: optional dependency megatron-core (through this module)

    config = config if config is not None else tiny_gpt_config()
    if layer_pattern is None:
        layer_pattern = ("*-" * config.num_layers)[: config.num_layers]
    return tiny_hybrid.build(config, layer_pattern, **_seeded_model_kwargs(**kwargs))


def build_tiny_model(kind: str = "gpt", config: Any = None, **kwargs: Any) -> Any:
    """`build_tiny_gpt` or `build_tiny_hybrid` by `kind` (one of MODEL_KINDS), same keywords."""
    builders = {"gpt": build_tiny_gpt, "hybrid": build_tiny_hybrid}
    if kind not in builders:
        raise ValueError(f"kind must be one of {MODEL_KINDS}, got {kind!r}")
    return builders[kind](config, **kwargs)


def tiny_provider(kind: str = "gpt", config: Any = None, **kwargs: Any) -> Callable[..., Any]:
    """A Megatron-LM style `model_provider(pre_process, post_process, vp_stage=None)` of `kind`."""

    def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None) -> Any:
        return build_tiny_model(
            kind, config, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage, **kwargs
        )

    return model_provider


def tiny_gpt_provider(config: Any = None, **kwargs: Any) -> Callable[..., Any]:
    """A Megatron-LM style `model_provider(pre_process, post_process, vp_stage=None)` of tiny GPTs."""
    return tiny_provider("gpt", config, **kwargs)


def wrap_ddp(model: Any, **ddp_flags: Any) -> Any:
    """Wrap in real megatron-core DistributedDataParallel with the given DistributedDataParallelConfig
    flags (e.g. overlap_grad_reduce=True, use_distributed_optimizer=True, overlap_param_gather=True)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    return DistributedDataParallel(
        config=model.config, ddp_config=DistributedDataParallelConfig(**ddp_flags), module=model
    )


def make_batch(batch_size: int = 2, seq_length: int = TINY_SEQ, vocab_size: int = TINY_VOCAB, seed: int = 0) -> dict:
    """Random tokens with a causal attention mask (True = masked out) and next-token labels."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch_size, seq_length + 1), generator=gen)
    causal = torch.ones(seq_length, seq_length, dtype=torch.bool).tril().logical_not()
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "position_ids": torch.arange(seq_length).expand(batch_size, seq_length).contiguous(),
        "attention_mask": causal[None, None].expand(batch_size, 1, seq_length, seq_length),
    }


def gpt_forward(model: Any, batch: dict, labels: bool = False) -> torch.Tensor:
    """Logits [b, s, V] (or per-token losses [b, s] with `labels=True`; a batch's "loss_mask" then
    goes along: the MTP heads' loss reads it)."""
    extra = {"loss_mask": batch["loss_mask"]} if labels and "loss_mask" in batch else {}
    return model(
        batch["tokens"],
        batch["position_ids"],
        batch["attention_mask"],
        labels=batch["labels"] if labels else None,
        **extra,
    )


def lm_loss_forward_step(data_iterator: Iterator[dict], model: Any) -> tuple[torch.Tensor, Callable]:
    """A forward step for get_forward_backward_func(): mean next-token cross entropy."""
    batch = next(data_iterator)
    per_token = gpt_forward(model, batch, labels=True)

    def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict]:
        loss = output.float().mean()
        return loss, {"lm loss": loss.detach().clone()}

    return per_token, loss_func


def run_schedule(
    model_chunks: Sequence[Any],
    batches: Sequence[dict],
    forward_step: Callable = lm_loss_forward_step,
    forward_only: bool = False,
) -> list[dict]:
    """One global batch through megatron-core's real forward-backward schedule (one data
    iterator over `batches` per model chunk: the interleaved schedule reads each chunk's own)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    first = batches[0]
    micro_batch_size, seq_length = first["tokens"].shape
    chunks = list(model_chunks)
    if not forward_only:
        check_interleaved_p2p(chunks)
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=[iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches),
        model=chunks,
        num_microbatches=len(batches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )


def check_interleaved_p2p(model_chunks: Sequence[Any]) -> None:
    """Refuse a training run of the interleaved schedule at 2 pipeline ranks over gloo with
    `config.batch_p2p_comm` (megatron-core's default): its steady state sends the activation
    (send_next) and the gradient (send_prev) to the same peer in one batch, posted in the order
    the peer does not receive them in (recv_prev, recv_next); gloo matches p2p messages per peer
    in order, so the two tensors of one shape are swapped and the later micro-batches' outputs and
    gradients come out wrong, silently. Megatron-LM itself runs virtual stages with
    `overlap_p2p_comm=True, batch_p2p_comm=False` (separate sends, another group per direction)."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_model_config

    chunks = list(model_chunks)
    if len(chunks) < 2 or parallel_state.get_pipeline_model_parallel_world_size() != 2:
        return
    if dist.get_backend(parallel_state.get_pipeline_model_parallel_group()) != "gloo":
        return
    if getattr(get_model_config(chunks[0]), "batch_p2p_comm", False):
        raise ValueError(
            "config.batch_p2p_comm is True with virtual pipeline stages at pipeline parallelism 2 on gloo: the "
            "interleaved schedule's batched sends to the one peer arrive swapped (activation for gradient), so "
            "the later micro-batches train on wrong values; build the chunks with batch_p2p_comm=False "
            "(tiny_pipeline_config does; Megatron-LM sets it with overlap_p2p_comm=True for virtual stages)"
        )


def sgd_step(model_chunks: Sequence[Any], lr: float = 0.1) -> None:
    """A tiny SGD on `param.main_grad` (the distributed optimizer does not build on CPU)."""
    with torch.no_grad():
        for chunk in model_chunks:
            for param in chunk.parameters():
                grad = getattr(param, "main_grad", None)
                if grad is None:
                    grad = param.grad
                if grad is not None:
                    param.add_(grad.to(param.dtype), alpha=-lr)


@dataclass
class MegatronCPU:
    """Handle given by `megatron_on_cpu()` / the `megatron_cpu` fixture: factories in one place.
    `model` / `model_provider` build `kind` ("gpt" or "hybrid"; see `with_kind`)."""

    seed: int = 1234
    kind: str = "gpt"
    config = staticmethod(tiny_gpt_config)
    gpt = staticmethod(build_tiny_gpt)
    hybrid = staticmethod(build_tiny_hybrid)
    provider = staticmethod(tiny_gpt_provider)
    ddp = staticmethod(wrap_ddp)
    batch = staticmethod(make_batch)
    forward = staticmethod(gpt_forward)
    run_schedule = staticmethod(run_schedule)
    sgd_step = staticmethod(sgd_step)

    def model(self, config: Any = None, **kwargs: Any) -> Any:
        """A tiny model of this handle's kind (same keywords as `build_tiny_gpt`)."""
        return build_tiny_model(self.kind, config, **kwargs)

    def model_provider(self, config: Any = None, **kwargs: Any) -> Callable[..., Any]:
        """A Megatron-LM style provider of this handle's kind."""
        return tiny_provider(self.kind, config, **kwargs)

    def with_kind(self, kind: str) -> MegatronCPU:
        """The same handle building `kind`; ModelKindUnavailable if megatron-core cannot build it."""
        if kind not in MODEL_KINDS:
            raise ValueError(f"kind must be one of {MODEL_KINDS}, got {kind!r}")
        if kind == "hybrid":
            # lazy: optional dependency megatron-core (through this module)
            import megatron_rl_patches.testing.tiny_hybrid  # noqa: F401  (its import raises ModelKindUnavailable)
        return replace(self, kind=kind)
