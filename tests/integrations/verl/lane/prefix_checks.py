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
    a multiple of `align`, the tensor-parallel size), the stream then padded to a multiple of `align`."""
    prefixes = set()
    for prompt, response in SAMPLES:
        tokens = torch.cat([prompt, response]).tolist()
        tokens += [0] * (-len(tokens) % align)
        prefixes.update(tuple(tokens[:n]) for n in range(1, len(tokens) + 1))
    return len(prefixes) + (-len(prefixes) % align)


def _pass(model: Any, fused: bool, forward_only: bool, on: bool) -> dict:
    """One verl pass over the batch: its outputs, loss, gradients and the rows the embedding ran."""
    from verl.workers.utils.losses import ppo_loss

    eng = kit.engine(fused, tf_config=model.config)
    eng.module = [model]
    rows: list[int] = []
    language_model = getattr(model, "module", model)
    handle = language_model.embedding.register_forward_pre_hook(
        lambda module, args, kwargs: rows.append(int(kwargs.get("input_ids", args[0] if args else None).numel())),
        with_kwargs=True)
    os.environ[settings.SHARED_PREFIX] = "1" if on else "0"
    try:
        loss_function = functools.partial(ppo_loss, kit.actor_config(kit.ENTROPY_COEFF))
        out = eng.forward_backward_batch(batch(), loss_function, forward_only=forward_only)
    finally:
        os.environ.pop(settings.SHARED_PREFIX, None)
        handle.remove()
    got = {key: [row.detach() for row in out["model_output"][key].unbind()] for key in ("log_probs", "entropy")}
    got["rows"] = rows
    if not forward_only:
        got["loss"] = torch.as_tensor(out["loss"]).detach().double()
        got["grads"] = kit.grads(model)
    return got


def _error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The largest relative difference over the rows verl reads (each response's, from row P - 1)."""
    prompts = [len(p) for p, _ in SAMPLES]
    return max(kit.relative(g[p - 1:-1], w[p - 1:-1]) for g, w, p in zip(got, want, prompts))


def prefix_checks(model: Any, align: int) -> dict:
    """Both routes' training step and the forward-only pass (unfused), planned against packed whole."""
    import time

    import megatron_rl_patches

    start = time.perf_counter()
    out: dict[str, Any] = {"trie_rows": trie_rows(align),
                           "logical_rows": sum(len(p) + len(r) + (-(len(p) + len(r)) % align) for p, r in SAMPLES)}
    for fused in (False, True):
        route = "fused" if fused else "unfused"
        megatron_rl_patches.apply(only="verl_fused_logprobs")
        try:
            for forward_only in ((False, True) if not fused else (False,)):
                whole, planned = (_pass(model, fused, forward_only, on) for on in (False, True))
                what = f"{route}-{'forward' if forward_only else 'train'}"
                out[what] = {"log_probs": _error(planned["log_probs"], whole["log_probs"]),
                             "entropy": _error(planned["entropy"], whole["entropy"]),
                             "rows_whole": whole["rows"], "rows_planned": planned["rows"]}
                if not forward_only:
                    out[what]["loss"] = kit.relative(planned["loss"], whole["loss"])
                    out[what]["grads"] = max(kit.relative(planned["grads"][n], whole["grads"][n])
                                             for n in whole["grads"])
                    out[what]["same_names"] = sorted(planned["grads"]) == sorted(whole["grads"])
                    # negative control: another sample's log-probs are told apart
                    out[what]["control"] = kit.relative(planned["log_probs"][3][5:10], whole["log_probs"][4][5:10])
        finally:
            megatron_rl_patches.revert()
    out["seconds"] = time.perf_counter() - start
    return out


def refusal(model: Any) -> str:
    """The error of a pass whose verl layout a plan cannot run: rank 0 packs no sequences
    (use_remove_padding=False), rank 1 trains MTP (each rank's own reason, agreed: the same error)."""
    import types

    import torch.distributed as dist
    from verl.workers.utils.losses import ppo_loss

    import megatron_rl_patches

    eng = kit.engine(False, tf_config=model.config)
    eng.module = [model]
    if dist.get_rank() == 0:
        eng.engine_config.use_remove_padding = False
    else:
        eng.model_config.mtp = types.SimpleNamespace(enable=True, enable_train=True)
    megatron_rl_patches.apply(only="verl_fused_logprobs")
    os.environ[settings.SHARED_PREFIX] = "1"
    try:
        eng.forward_backward_batch(batch(), functools.partial(ppo_loss, kit.actor_config()), forward_only=False)
    except ValueError as error:
        return str(error)
    finally:
        os.environ.pop(settings.SHARED_PREFIX, None)
        megatron_rl_patches.revert()
    return "no error"
