"""Shared-prefix packing in verl 0.9.1's real engine passes, run inside a rank of test_verl_layouts'
world: `MegatronEngine.forward_backward_batch` (verl's micro-batching, megatron-core's schedule, its
`forward_step` through `gptmodel_forward_model_engine` or the fused twin, `preprocess_thd_engine`,
`postprocess_thd_engine`, `ppo_loss`) with MEGATRON_RL_PATCHES_SHARED_PREFIX=1 against the same pass
with it off, on one model: the training step (log-probs, entropy, loss, every gradient) and the
forward-only pass (log-probs, entropy), both routes; the rows the embedding computes, against the
trie of the sequences as verl packs them; a verl layout refused by name on every rank."""
from __future__ import annotations

import functools
import os
import types
from typing import Any

import torch
import verl_kit as kit

from megatron_rl_patches import settings

# GRPO groups and turns: prompt A with three answers (two sharing their first tokens), prompt B with
# two, the next turn of A's first answer (that whole sample its prefix), and one sample alone
_GEN = torch.Generator().manual_seed(5)
PREFIX_TOLERANCE = 1e-6  # float32: the plan against each sample packed whole, relative to the largest value


def _ids(n: int) -> torch.Tensor:
    return torch.randint(1, kit.VOCAB, (n,), generator=_GEN)


PROMPT_A, PROMPT_B, SHARED_ANSWER = _ids(7), _ids(6), _ids(2)
ANSWER_A = torch.cat([SHARED_ANSWER, _ids(3)])
SAMPLES = [  # (prompt, response)
    (PROMPT_A, ANSWER_A),
    (PROMPT_A, torch.cat([SHARED_ANSWER, _ids(2)])),
    (PROMPT_A, _ids(4)),
    (PROMPT_B, _ids(6)),
    (PROMPT_B, _ids(5)),
    (torch.cat([PROMPT_A, ANSWER_A, _ids(2)]), _ids(3)),
    (_ids(5), _ids(4)),
]


def batch() -> Any:
    """The samples as verl's trainer hands its actor a batch, one micro-batch of all of them."""
    prompts = tuple(len(p) for p, _ in SAMPLES)
    responses = tuple(len(r) for _, r in SAMPLES)
    return kit.rl_batch(prompts, responses, temperature=kit.TEMPERATURE, ids=[torch.cat(s) for s in SAMPLES],
                        calculate_entropy=True, use_dynamic_bsz=False, micro_batch_size_per_gpu=len(SAMPLES))


def trie_rows(align: int) -> int:
    """The distinct leading-token sequences of the samples as verl packs them (each padded with 0 to
    a multiple of `align`: TP, times 2 CP under context parallelism), the stream then padded to a
    multiple of `align` (the sharing plan pads to the same)."""
    prefixes = set()
    for prompt, response in SAMPLES:
        tokens = torch.cat([prompt, response]).tolist()
        tokens += [0] * (-len(tokens) % align)
        prefixes.update(tuple(tokens[:n]) for n in range(1, len(tokens) + 1))
    return len(prefixes) + (-len(prefixes) % align)


def layout_grads(model: Any) -> dict:
    """Every parameter's gradient as the optimizer sees it: summed over the context-parallel ranks (each
    holds its rows' share, and a sharing plan's rows are not the packed micro-batch's), a
    sequence-parallel one (the norms') over the tensor-parallel ranks too, as `finalize_model_grads`
    does."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    out = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        grad = param.grad.detach().clone()
        if parallel_state.get_context_parallel_world_size() > 1:
            dist.all_reduce(grad, group=parallel_state.get_context_parallel_group())
        if getattr(param, "sequence_parallel", False) and parallel_state.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
        out[name] = grad
    model.zero_grad(set_to_none=True)
    return out


def _pass(model: Any, fused: bool, forward_only: bool, on: bool, mtp: Any = None, **engine_config: Any) -> dict:
    """One verl pass over the batch: its outputs, loss, gradients, the MTP losses verl logs and the rows
    the embedding ran (`engine_config`: verl's engine settings changed for it; `mtp`: verl's MTP config)."""
    from verl.workers.utils.losses import ppo_loss

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    eng = kit.engine(fused, tf_config=chunks[0].config)
    eng.module = chunks
    if mtp is not None:
        eng.model_config.mtp = mtp
    for key, value in engine_config.items():
        object.__setattr__(eng.engine_config, key, value)  # verl's config fields are frozen
    rows: list[int] = []
    handles = [getattr(chunk, "module", chunk).embedding.register_forward_pre_hook(
        lambda module, args, kwargs: rows.append(int(kwargs.get("input_ids", args[0] if args else None).numel())),
        with_kwargs=True) for chunk in chunks if getattr(getattr(chunk, "module", chunk), "pre_process", True)]
    os.environ[settings.SHARED_PREFIX] = "1" if on else "0"
    try:
        loss_function = functools.partial(ppo_loss, kit.actor_config(kit.ENTROPY_COEFF))
        out = eng.forward_backward_batch(batch(), loss_function, forward_only=forward_only)
    finally:
        os.environ.pop(settings.SHARED_PREFIX, None)
        for handle in handles:
            handle.remove()
    got: dict[str, Any] = {"rows": rows}
    if out:  # the last pipeline stage: verl's outputs and loss
        got.update({key: [row.detach() for row in out["model_output"][key].unbind()]
                    for key in ("log_probs", "entropy")})
        if not forward_only:
            got["loss"] = torch.as_tensor(out["loss"]).detach().double()
        got["mtp_losses"] = {key: value for key, value in out.get("metrics", {}).items() if "mtp" in key}
    if not forward_only:
        got["grads"] = {f"chunk{i}.{name}": grad for i, chunk in enumerate(chunks)
                        for name, grad in layout_grads(chunk).items()}
    return got


def _error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The largest relative difference over the rows verl reads (each response's, from row P - 1)."""
    prompts = [len(p) for p, _ in SAMPLES]
    return max(kit.relative(g[p - 1:-1], w[p - 1:-1]) for g, w, p in zip(got, want, prompts))


def mtp_model(depth: int = 1, context: int = 1) -> Any:
    """A packed GPTModel with a `depth`-deep MTP block (megatron-core's local spec, the kit's packed attention;
    at `context` > 1 its CPU context-parallel attention, zigzag), verl's MTP patches applied as its engine
    applies them (`patch_engine_mtp`: its own GPT postprocess)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from verl.utils.megatron_utils import patch_engine_mtp

    from megatron_rl_patches.testing.mtp_gpt import tiny_mtp_config
    from megatron_rl_patches.testing.packed_gpt import packed_gpt_spec

    config = tiny_mtp_config(mtp_num_layers=depth, context_parallel_size=context)
    if context > 1:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        from megatron_rl_patches.testing.cp_attention import cp_layer_spec

        spec = cp_layer_spec("zigzag", get_gpt_layer_local_spec())
    else:
        spec = packed_gpt_spec()
    torch.manual_seed(3)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=kit.VOCAB, max_sequence_length=64,
                     position_embedding_type="rope",
                     mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False))
    patch_engine_mtp(model, types.SimpleNamespace(mtp=MTP))
    return model


MTP = types.SimpleNamespace(enable=True, enable_train=True, detach_encoder=False)


def mtp_checks(model: Any) -> dict:
    """verl's training step with MTP training (verl's label roll, its own MTP loss), planned against packed
    whole: log-probs, entropy, the loss, the MTP losses verl logs and every gradient (the MTP block's too)."""
    import megatron_rl_patches

    megatron_rl_patches.apply(only="verl_fused_logprobs")
    try:
        whole, planned = (_pass(model, False, False, on, mtp=MTP) for on in (False, True))
    finally:
        megatron_rl_patches.revert()
    mtp_keys = sorted(whole["mtp_losses"])
    return {"log_probs": _error(planned["log_probs"], whole["log_probs"]),
            "entropy": _error(planned["entropy"], whole["entropy"]),
            "loss": kit.relative(planned["loss"], whole["loss"]),
            "grads": max(kit.relative(planned["grads"][n], whole["grads"][n]) for n in whole["grads"]),
            "mtp_grads": max(kit.relative(planned["grads"][n], whole["grads"][n])
                             for n in whole["grads"] if ".mtp." in n),
            "mtp_losses": {key: (whole["mtp_losses"][key], planned["mtp_losses"].get(key)) for key in mtp_keys},
            "same_names": sorted(planned["grads"]) == sorted(whole["grads"]),
            "rows_whole": whole["rows"], "rows_planned": planned["rows"]}


ALL_PASSES = ("unfused-train", "unfused-forward", "fused-train")


def prefix_checks(model: Any, align: int, context: int = 1, passes: tuple[str, ...] = ALL_PASSES) -> dict:
    """`passes` (both routes' training step and the forward-only pass, unfused), planned against packed
    whole, at tensor-parallel size `align` and context-parallel size `context` (the embedding's rows per
    rank)."""
    import time

    import megatron_rl_patches

    start = time.perf_counter()
    padding = align * (2 * context if context > 1 else 1)  # verl's per-sequence padding, and the plan's
    out: dict[str, Any] = {"trie_rows": trie_rows(padding) // context,
                           "logical_rows": sum(len(p) + len(r) + (-(len(p) + len(r)) % padding)
                                               for p, r in SAMPLES) // context}
    for fused in (False, True):
        route = "fused" if fused else "unfused"
        megatron_rl_patches.apply(only="verl_fused_logprobs")
        try:
            for forward_only in (False, True):
                what = f"{route}-{'forward' if forward_only else 'train'}"
                if what not in passes:
                    continue
                whole, planned = (_pass(model, fused, forward_only, on) for on in (False, True))
                out[what] = {"rows_whole": whole["rows"], "rows_planned": planned["rows"]}
                if "log_probs" in whole:  # the last pipeline stage
                    out[what].update(log_probs=_error(planned["log_probs"], whole["log_probs"]),
                                     entropy=_error(planned["entropy"], whole["entropy"]))
                    # negative control: another sample's log-probs are told apart
                    out[what]["control"] = kit.relative(planned["log_probs"][3][5:10], whole["log_probs"][4][5:10])
                if "loss" in whole:
                    out[what]["loss"] = kit.relative(planned["loss"], whole["loss"])
                if not forward_only:
                    out[what]["grads"] = max(kit.relative(planned["grads"][n], whole["grads"][n])
                                             for n in whole["grads"])
                    out[what]["same_names"] = sorted(planned["grads"]) == sorted(whole["grads"])
        finally:
            megatron_rl_patches.revert()
    out["seconds"] = time.perf_counter() - start
    return out


def fallback_checks(model: Any) -> dict:
    """A verl setting a sharing plan cannot run (router replay on both ranks: `router_replay.mode`, read by
    the door alone here, verl's kit engine replaying nothing): the pass packs each sample whole, its
    log-probs those of the setting off bit for bit, the embedding's rows the packed ones, and one warning
    naming verl's setting, the same on both ranks."""
    import logging
    import types

    import megatron_rl_patches
    from megatron_rl_patches._log import forget_warnings

    heard: list[str] = []

    class Heard(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            heard.append(record.getMessage())

    logger, handler = logging.getLogger("megatron_rl_patches"), Heard(logging.DEBUG)
    level = logger.level
    forget_warnings()
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    megatron_rl_patches.apply(only="verl_fused_logprobs")
    try:
        replay = types.SimpleNamespace(mode="R3")
        whole, fallen = (_pass(model, False, True, on, router_replay=replay) for on in (False, True))
    finally:
        megatron_rl_patches.revert()
        logger.removeHandler(handler)
        logger.setLevel(level)
    return {"log_probs": _error(fallen["log_probs"], whole["log_probs"]), "rows": (whole["rows"], fallen["rows"]),
            "said": [line for line in heard if "runs each sample packed whole" in line]}


def strict_refusal(model: Any) -> str:
    """The error of a pass under MEGATRON_RL_PATCHES_STRICT=1 whose verl layout a sharing plan cannot run:
    rank 0 packs no sequences (use_remove_padding=False), rank 1 replays routes (each rank's own reason,
    agreed before the pass's first collective: the same error)."""
    import types

    import torch.distributed as dist
    from verl.workers.utils.losses import ppo_loss

    import megatron_rl_patches

    eng = kit.engine(False, tf_config=model.config)
    eng.module = [model]
    if dist.get_rank() == 0:
        eng.engine_config.use_remove_padding = False
    else:
        object.__setattr__(eng.engine_config, "router_replay", types.SimpleNamespace(mode="R3"))
    megatron_rl_patches.apply(only="verl_fused_logprobs")
    os.environ[settings.SHARED_PREFIX] = os.environ[settings.STRICT] = "1"
    try:
        eng.forward_backward_batch(batch(), functools.partial(ppo_loss, kit.actor_config()), forward_only=False)
    except ValueError as error:
        return str(error)
    finally:
        os.environ.pop(settings.SHARED_PREFIX, None)
        os.environ.pop(settings.STRICT, None)
        megatron_rl_patches.revert()
    return "no error"
