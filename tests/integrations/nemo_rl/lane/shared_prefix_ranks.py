"""The NeMo-RL lane's shared-prefix world: NeMo-RL 7ea279ab's own driver (`get_microbatch_iterator`
+ `megatron_forward_backward`, sequence packing on) over groups of samples sharing their prompts,
with `nemo_rl_shared_prefix` applied and MEGATRON_RL_PATCHES_SHARED_PREFIX on and off: each pass's
outputs, losses and gradients, and the tokens the embedding was handed. Imported in each spawned
rank: the service stand-ins are installed before NeMo-RL is imported."""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

from megatron_rl_patches.testing.service_stubs import install_service_stubs  # noqa: E402

install_service_stubs()

import nemo_kit as kit  # noqa: E402
import torch  # noqa: E402

from megatron_rl_patches.settings import SHARED_PREFIX  # noqa: E402

SEQ, K, MBS = 16, 8, 4
# two groups interleaved in each micro-batch of 4 (prompts of 7 and 6 tokens; the last sample of
# group A shares only 3 of them: a plan found by value, not by a claimed group)
PROMPTS = {"A": 7, "B": 6}
SAMPLES = (("A", 5), ("B", 6), ("A", 3), ("B", 4), ("A", 8), ("B", 9), ("A'", 2), ("B", 1))
OWN = ("nemo_rl_shared_prefix",)
FUSED = ("nemo_rl_shared_prefix", "nemo_rl_fused_logprobs", "nemo_rl_topk", "nemo_rl_topk_kd")


def batch(teacher: Any = None) -> Any:
    """8 samples of two groups, ids padded to SEQ, GRPO's fields (and the distillation teacher's)."""
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    gen = torch.Generator().manual_seed(11)
    prompts = {name: torch.randint(1, kit.VOCAB, (length,), generator=gen) for name, length in PROMPTS.items()}
    ids, lengths, mask = torch.zeros(len(SAMPLES), SEQ, dtype=torch.long), [], torch.zeros(len(SAMPLES), SEQ)
    for row, (group, answer) in enumerate(SAMPLES):
        prompt = prompts["A"].clone() if group == "A'" else prompts[group]
        if group == "A'":
            prompt[3:] = torch.randint(1, kit.VOCAB, (len(prompt) - 3,), generator=gen)
        tokens = torch.cat([prompt, torch.randint(1, kit.VOCAB, (answer,), generator=gen)])
        ids[row, :len(tokens)] = tokens
        mask[row, len(prompt):len(tokens)] = 1
        lengths.append(len(tokens))
    count = len(SAMPLES)
    data = {"input_ids": ids, "input_lengths": torch.tensor(lengths), "token_mask": mask,
            "sample_mask": torch.ones(count), "advantages": torch.randn(count, SEQ, generator=gen),
            "prev_logprobs": -torch.rand(count, SEQ, generator=gen) * 4 - 2,
            "generation_logprobs": -torch.rand(count, SEQ, generator=gen) * 4 - 2,
            "reference_policy_logprobs": -torch.rand(count, SEQ, generator=gen) * 4 - 2}
    if teacher is not None:
        data["teacher_topk_logits"], data["teacher_topk_indices"] = teacher
    result = BatchedDataDict(data)
    result.micro_batch_indices = [[[start, start + MBS] for start in range(0, count, MBS)]]
    result.micro_batch_lengths = [[SEQ] * (count // MBS)]
    return result


def drive(model: Any, data: Any, cfg: dict, post: Any, forward_only: bool = True) -> list:
    """NeMo-RL's own driver over `data` (sequence packing on: micro-batches as `batch` cut them)."""
    from nemo_rl.models.megatron.data import get_microbatch_iterator
    from nemo_rl.models.megatron.train import megatron_forward_backward

    iterator, count, micro, _, padded = get_microbatch_iterator(data, cfg, MBS, straggler_timer=None)
    seqs, toks = kit.valid_counts(data)
    return megatron_forward_backward(model=model, data_iterator=iterator, num_microbatches=count, seq_length=padded,
                                     mbs=micro, post_processing_fn=post, forward_only=forward_only,
                                     global_valid_seqs=seqs, global_valid_toks=toks)


class EmbeddingCount:
    """The tokens the model's embedding was handed while open."""

    def __init__(self, model: Any) -> None:
        self.embedding = next((m for m in model.modules() if type(m).__name__ == "LanguageModelEmbedding"), None)
        self.tokens = 0

    def __enter__(self) -> EmbeddingCount:
        def count(module: Any, args: tuple, kwargs: dict) -> None:
            ids = kwargs.get("input_ids", args[0] if args else None)
            self.tokens += int(ids.numel())

        self.handle = None if self.embedding is None else self.embedding.register_forward_pre_hook(count,
                                                                                                   with_kwargs=True)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.handle is not None:
            self.handle.remove()


@contextlib.contextmanager
def setting(on: bool, names: tuple[str, ...]) -> Iterator[None]:
    """`names` applied, MEGATRON_RL_PATCHES_SHARED_PREFIX on or unset."""
    import megatron_rl_patches

    before = os.environ.pop(SHARED_PREFIX, None)
    if on:
        os.environ[SHARED_PREFIX] = "1"
    megatron_rl_patches.apply(list(names), strict=True)
    try:
        yield
    finally:
        megatron_rl_patches.revert()
        os.environ.pop(SHARED_PREFIX, None)
        if before is not None:
            os.environ[SHARED_PREFIX] = before


def both(model: Any, run: Any, names: tuple[str, ...]) -> tuple[Any, Any, tuple[int, int]]:
    """`run()` with the setting off, then on; and the tokens the embedding was handed in each."""
    results, tokens = [], []
    for on in (False, True):
        with setting(on, names), EmbeddingCount(model) as counted:
            results.append(run())
        tokens.append(counted.tokens)
    return results[0], results[1], (tokens[0], tokens[1])


def _err(a: Any, b: Any) -> float:
    return float((a.double() - b.double()).abs().max()) if a is not None and a.numel() else 0.0


def _cat(results: list, key: str) -> torch.Tensor | None:
    return torch.cat([r[key] for r in results]) if results else None


def _grads(model: Any) -> list[torch.Tensor]:
    """Every parameter's gradient as the optimizer sees it: summed over the context-parallel ranks and a
    sequence-parallel one (the norms') over the tensor-parallel group, as megatron-core's DDP and
    finalize_model_grads do (each rank holds its rows' share, and a plan's rows are not the packed
    micro-batch's)."""
    from megatron.core import parallel_state

    grads = []
    for param in model.parameters():
        grad = torch.zeros_like(param) if param.grad is None else param.grad.detach().clone()
        if parallel_state.get_context_parallel_world_size() > 1:
            torch.distributed.all_reduce(grad, group=parallel_state.get_context_parallel_group())
        if getattr(param, "sequence_parallel", False):
            torch.distributed.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
        grads.append(grad)
    return grads


def logprob_figures(model: Any, cfg: dict, names: tuple[str, ...]) -> dict:
    from nemo_rl.models.megatron.train import LogprobsPostProcessor

    off, on, tokens = both(model, lambda: _cat(drive(model, batch(), cfg, LogprobsPostProcessor(cfg, None)),
                                               "logprobs"), names)
    return {"err": _err(off, on), "tokens": tokens, "scale": 0.0 if off is None else float(off.abs().max())}


def topk_figures(model: Any, cfg: dict) -> dict:
    from nemo_rl.models.megatron.train import TopkLogitsPostProcessor

    off, on, tokens = both(model, lambda: drive(model, batch(), cfg, TopkLogitsPostProcessor(cfg, K)),
                           ("nemo_rl_shared_prefix", "nemo_rl_topk"))
    valid = torch.arange(SEQ)[None] < batch()["input_lengths"][:, None]
    return {"tokens": tokens, "ids_equal": bool((_cat(off, "topk_indices") == _cat(on, "topk_indices"))
                                                              [valid].all()),
            "err": float((_cat(off, "topk_logits") - _cat(on, "topk_logits"))[valid].abs().max()),
            "teacher": (_cat(off, "topk_logits"), _cat(off, "topk_indices"))}


def step_figures(model: Any, cfg: dict, names: tuple[str, ...], loss_fn: Any, data: Any) -> dict:
    """A training step (LossPostProcessor over `loss_fn`, backward through NeMo-RL's schedule): the
    loss and every gradient, off against on."""
    from nemo_rl.models.megatron.train import LossPostProcessor

    def step() -> tuple[float, list[torch.Tensor]]:
        for param in model.parameters():
            param.grad = None
        results = drive(model, data, cfg, LossPostProcessor(loss_fn, cfg, num_microbatches=2), forward_only=False)
        return (sum(float(r["loss"]) for r in results) if results else 0.0), _grads(model)

    (loss_off, grads_off), (loss_on, grads_on), tokens = both(model, step, names)
    return {"loss": (loss_off, loss_on), "grad_err": max(_err(a, b) for a, b in zip(grads_off, grads_on)),
            "grad_scale": max(float(g.abs().max()) for g in grads_off), "tokens": tokens}


def build_model(layout: dict, seed: int = 0) -> Any:
    """The lane's tiny GPTModel at `layout` (one pipeline stage)."""
    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    config = tiny_gpt_config(tensor_model_parallel_size=layout["tp"], sequence_parallel=layout["sp"],
                             context_parallel_size=layout["cp"], num_layers=2)
    return build_packed_gpt(vocab_size=kit.VOCAB, seq_length=64, seed=seed, config=config,
                            context_parallel_layout="zigzag" if layout["cp"] > 1 else None)


class Heard(logging.Handler):
    """The package's log lines on this rank, every level (rank 0 warns; the others say it at debug)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def heard() -> Iterator[Heard]:
    from megatron_rl_patches._log import forget_warnings

    logger, handler = logging.getLogger("megatron_rl_patches"), Heard()
    level = logger.level
    forget_warnings()
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def refusal_figures(model: Any, cfg: dict) -> dict:
    """A call the plan cannot run (sequence packing off): the log-prob pass with the setting on says why
    once in NeMo-RL's words (the same on every rank) and runs each sample whole, as with the setting off."""
    with heard() as lines:
        figures = logprob_figures(model, cfg, OWN)
    said = [line for line in lines.lines if "runs each sample packed whole" in line]
    return {**figures, "said": said}


def strict_figures(model: Any, cfg: dict) -> dict:
    """The same pass under MEGATRON_RL_PATCHES_STRICT=1: the same words raise a ValueError on every rank."""
    from megatron_rl_patches.settings import STRICT

    os.environ[STRICT] = "1"
    try:
        logprob_figures(model, cfg, OWN)
    except ValueError as error:
        return {"error": str(error)}
    finally:
        os.environ.pop(STRICT, None)
    return {"error": None}


def prefix_world(rank: int, world: int, layouts: list[dict]) -> list[dict]:
    """Every check at each layout of `layouts`, in one spawned world."""
    import nemo_rl.models.megatron.train  # noqa: F401 - loaded before the shims: they unpin torch.tensor where it is
    from nemo_rl.algorithms.loss.loss_functions import (
        ClippedPGLossConfig,
        ClippedPGLossFn,
        DistillationLossConfig,
        DistillationLossFn,
    )

    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    results = []
    for layout in layouts:
        with megatron_on_cpu(tensor_parallel=layout["tp"], context_parallel=layout["cp"]):
            cfg = kit.policy_cfg(packed=True, tp=layout["tp"], sp=layout["sp"], cp=layout["cp"])
            model = build_model(layout)
            out: dict[str, Any] = {"layout": layout["name"]}
            out["logprobs_own"] = logprob_figures(model, cfg, OWN)
            out["logprobs_fused"] = logprob_figures(model, cfg, FUSED)
            topk = topk_figures(build_model(layout, seed=7), cfg)  # a distillation teacher's pass
            out["topk"] = {key: value for key, value in topk.items() if key != "teacher"}
            grpo = ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.05))
            out["grpo_own"] = step_figures(model, cfg, OWN, grpo, batch())
            out["grpo_fused"] = step_figures(model, cfg, FUSED, grpo, batch())
            teacher = topk["teacher"]
            kd = DistillationLossFn(DistillationLossConfig(kl_type="mixed", mixed_kl_weight=0.3))
            out["kd_fused"] = step_figures(model, cfg, FUSED, kd, batch(teacher))
            if layout["cp"] == 1:  # NeMo-RL cuts over context-parallel ranks only what it packs
                out["unpacked"] = refusal_figures(model, kit.policy_cfg(tp=layout["tp"], sp=layout["sp"]))
                out["strict"] = strict_figures(model, kit.policy_cfg(tp=layout["tp"], sp=layout["sp"]))
            results.append(out)
    return results


def layout(name: str, tp: int = 1, sp: bool = False, cp: int = 1) -> dict:
    return {"name": name, "tp": tp, "sp": sp, "cp": cp}
