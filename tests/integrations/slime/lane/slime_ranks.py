"""One rank of a slime lane world (`run_multirank` spawns each rank as a fresh interpreter): the
stand-ins installed, Megatron's parallel state on gloo, slime's arguments for the layout. What a
rank runs is a function of this module, so spawned ranks import it by name."""
from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from megatron_rl_patches.testing.layouts import BY_MARKER

HERE = os.path.dirname(__file__)
OPD_LOSS = "megatron_rl_patches.integrations.slime_opd.topk_opd_policy_loss"
OPD_ENV = {"TEACHERS": "teacher-a,teacher-b", "WEIGHTS": "0.3,0.7", "K": "4", "DIVERGENCE": "forward_kl",
           "POLICY_WEIGHT": "0", "COEF": "1"}
TEMPERATURE = 0.8
ACTOR_SPEC = ("--spec", "slime_kit", "packed_spec")  # the actor's custom local spec: the kit's packed attention


@contextlib.contextmanager
def lane_rank(rank: int, world_size: int, *, pipeline: int = 1, context: int = 1, tensor: int = 1,
              virtual: int | None = None, expert: int = 1) -> Iterator[Any]:
    """The rank's lane setup (as the lane's conftest for one rank); yields a pytest MonkeyPatch."""
    from _pytest.monkeypatch import MonkeyPatch

    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import slime_megatron_patch
    import slime_standins

    slime_megatron_patch.install()
    slime_standins.install()
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    slime_standins.cpu_accelerator()
    patch = MonkeyPatch()
    patch.setenv("RANK", str(rank))  # Megatron-LM's parse_args reads the world from the launcher's variables
    patch.setenv("WORLD_SIZE", str(world_size))
    patch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # Megatron-LM's validate_args wants it at TP or CP > 1
    slime_standins.cpu_pinned_memory(patch)
    try:
        with megatron_on_cpu(tensor_parallel=tensor, pipeline_parallel=pipeline, virtual_pipeline=virtual,
                             context_parallel=context, expert_parallel=expert):
            yield patch
    finally:
        patch.undo()


def _named(model: list[Any]) -> dict[str, Any]:
    """The parameters of every model chunk of this rank under the whole model's names (a layer by
    its global `layer_number`, whatever the pipeline or virtual-pipeline split)."""
    from megatron.core import parallel_state

    from megatron_rl_patches.testing.moe_gpt import global_expert_name

    named = {}
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    for chunk in model:
        while hasattr(chunk, "module"):
            chunk = chunk.module
        experts = getattr(chunk.config, "num_moe_experts", None) or 1
        for name, p in chunk.named_parameters():
            if name.startswith("decoder.layers."):
                index, rest = name[len("decoder.layers."):].split(".", 1)
                name = f"decoder.layers.{chunk.decoder.layers[int(index)].layer_number - 1}.{rest}"
            name = global_expert_name(name, ep_rank, experts // parallel_state.get_expert_model_parallel_world_size())
            assert name not in named, name
            named[name] = p
    return named


def _stage_state(model: list[Any]) -> dict[str, Any]:
    return {name: p.detach().clone() for name, p in _named(model).items()}


def _partition_dims(model: list[Any]) -> dict[str, int | None]:
    """Per parameter, the dimension tensor parallelism splits (None: replicated)."""
    return {name: p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
            for name, p in _named(model).items()}


def first_grads(patch: Any, optimizer: Any, model: list[Any]) -> dict[str, Any]:
    """Filled at the first optimizer step with this rank's reduced gradients (`main_grad`, before
    the optimizer consumes them)."""
    grads: dict[str, Any] = {}
    step = optimizer.step

    def step_noting_grads(*args: Any, **kwargs: Any) -> Any:
        if not grads:
            grads.update({name: p.main_grad.clone() for name, p in _named(model).items()})
        return step(*args, **kwargs)

    patch.setattr(optimizer, "step", step_noting_grads)
    return grads


def _response_rows(data: dict) -> list[list[int]] | None:
    """Per sample, the response rows this context-parallel rank holds, in slime's zigzag order
    (slime's own offsets); None without context parallelism."""
    from megatron.core import parallel_state
    from slime.backends.megatron_utils.cp_utils import get_logits_and_tokens_offset_with_cp

    if parallel_state.get_context_parallel_world_size() == 1:
        return None
    rows = []
    for total, response in zip(data["total_lengths"], data["response_lengths"]):
        _, _, logits, _ = get_logits_and_tokens_offset_with_cp(total, response)
        start = total - response - 1  # the logits row of the first response token
        rows.append([row - start for lo, hi in logits for row in range(lo, hi)])
    return rows


def _whole_gradients(replicas: int) -> dict[str, bool]:
    """With `replicas` > 1 ranks in the data-parallel group (with context parallelism it spans the
    CP ranks; DP=2 with or without EP=2) the distributed optimizer would leave each rank the reduced
    gradients of its own shard only (the rest: its own, pre-scaled): the test reads every gradient, so those worlds keep
    whole reduced gradients (the plain optimizer)."""
    return {"use_distributed_optimizer": False, "overlap_param_gather": False} if replicas > 1 else {}


def virtual_args(virtual: int | None) -> tuple[str, ...]:
    """slime's flags for `virtual` model chunks per pipeline rank (one layer each)."""
    return () if virtual is None else ("--num-layers", str(2 * virtual), "--num-layers-per-virtual-pipeline-stage", "1")


# An allgather-CP model (slime 624b824a serves --allgather-cp for DSA architectures only, checked by
# `_validate_allgather_cp_supported` against the HF config): the lane declares one. The tiny GPT has
# no positional embedding there (megatron-core's thd RoPE cuts each sequence in zigzag; a DSA model
# brings its own positions).
DSA_CONFIG = {"architectures": ["DeepseekV32ForCausalLM"]}
ALLGATHER_CP = BY_MARKER["cp2-allgather"].megatron_lm_args  # testing/layouts.py: --allgather-cp, no positions


def declared_dsa(args: Any) -> None:
    """slime's own allgather-CP check, passed by the declared DSA architecture."""
    from types import SimpleNamespace

    from slime.backends.megatron_utils.arguments import _validate_allgather_cp_supported

    _validate_allgather_cp_supported(args, SimpleNamespace(**DSA_CONFIG))


# The separate-architecture teacher (`PATH@slime_ranks:wide_teacher`): the packed tiny GPT wider
# and deeper than the actor, the same vocabulary, built inference-only on the actor's PP split.
WIDE = {"hidden_size": 48, "ffn_hidden_size": 192, "kv_channels": 12, "num_layers": 4}


def wide_config(args: Any) -> Any:
    import dataclasses

    from megatron.training.arguments import core_transformer_config_from_args

    return dataclasses.replace(core_transformer_config_from_args(args), **WIDE)


def wide_teacher(args: Any) -> Any:
    """The `module:function` of the separate teacher: its Megatron model provider."""
    import functools

    import slime_kit as kit

    return functools.partial(kit.provider_func(args), config=wide_config(args))


def save_wide_teacher(args: Any, path: str) -> None:
    """A torch_dist checkpoint of the wide teacher (seeded weights) from this world (the test saves
    it at one rank; a PP=2 world loads it resharded, as jobs load teachers saved at other layouts)."""
    import torch
    from megatron.core import dist_checkpointing

    from megatron_rl_patches.inference import build_inference_model

    chunks = build_inference_model(wide_teacher(args))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in (p for chunk in chunks for p in chunk.parameters()):
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
    module = chunks[0]
    while hasattr(module, "module"):
        module = module.module
    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save({"model": module.sharded_state_dict()}, path)


def actor_rollout(seed: int, samples: list[dict] | None = None) -> dict:
    """A rollout as slime's rollout manager hands it to `train_actor` (rewards, micro-batch counts;
    every data-parallel rank holds the whole rollout, so the step's global batch counts them all);
    `samples`: the rollouts' per-sample fields given by the test (indexed by `seed`)."""
    import slime_kit as kit
    from megatron.core import parallel_state

    data = kit.rollout(seed) if samples is None else dict(samples[seed % len(samples)])
    rewards = [1.0, 0.0, 0.5, -1.0] * (len(data["tokens"]) // 4 + 1)  # these four, again for a longer rollout
    data.update(rewards=rewards[:len(data["tokens"])], num_microbatches=[len(data["micro_batch_indices"])],
                global_batch_sizes=[len(data["tokens"]) * parallel_state.get_data_parallel_world_size()])
    return data


def opd_train_actor(rank: int, world_size: int, pipeline: int, context: int = 1, tensor: int = 1,
                    virtual: int | None = None, hf_teacher: str | None = None, flags: tuple[str, ...] = (),
                    rollouts: int = 1, wide_path: str | None = None, expert: int = 1,
                    weights: str | None = None, cross: dict[str, Any] | None = None,
                    served: dict[str, str] | None = None, env: dict[str, str] | None = None,
                    contexts: list[dict] | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """slime_opd with two teachers through slime's real `MegatronTrainRayActor.train_actor`
    (slime's log-probs, advantages, `log_rollout_data`, `train()`), on `pipeline` stages, with
    slime's extra `flags`; `rollouts` train_actor calls in a row (re-entry). Returns this stage's
    named parameters (actor and each teacher, before the first step), its reduced gradients of the
    first step and, on the last stage, the ids and the teachers' log-probs scored first and every
    step's losses. `hf_teacher`: the teachers after the first are these Hugging Face directories of
    other architectures (comma-separated; their layers on the actor's attention core, the kit's
    packed-input one named by `--spec`, which stands for Transformer Engine's on CPU), `weights`
    the mixture's (default OPD_ENV's); `wide_path`: the second teacher is
    `wide_path@slime_ranks:wide_teacher` (`save_wide_teacher`'s checkpoint); `cross`: the second
    teacher is the Hugging Face directory cross["teacher"] with its own tokenizer
    (`;tokenizer=own`), the student's tokenizer in cross["student"] (slime's --hf-checkpoint), its
    vocabulary cross["vocab"], the rollouts' samples cross["samples"] (cross["entries"]: the
    teachers' entries instead; cross["seeds"]: the seed of each further snapshot path's weights;
    cross["more_micro_batches"]: the teacher's agreed micro-batch count raised by that many, as if
    another data-parallel rank planned more: its samples split, then its shortest one repeated);
    cross["temperature"]: the rollout's temperature (a served teacher's: 1); `served`: the teachers'
    entries served["entries"] (a served teacher first), the ids from the
    teacher (served["ids_from"]: from whom), the student's tokenizer in served["student"]
    (served["rollouts"]: the rollouts' per-sample fields, as `cross["samples"]`), the rollout at
    temperature 1 (served["temperature"]: another, a served teacher with a head; served["contexts"]:
    each sample's privileged contexts as the rollout manager's split carries them); `contexts`: the
    same for any teachers' entries; `env`: OPD variables
    set last (their names without MEGATRON_RL_PATCHES_OPD_, e.g. {"K": "vocab"}); `extra`: {"shared_prefix":
    True} sets MEGATRON_RL_PATCHES_SHARED_PREFIX=1, {"rollouts": [...]} the rollouts' per-sample fields (as
    `cross["samples"]`), {"ref": True} loads a reference snapshot (slime's
    ref_ pass), {"snapshot_scale": s} draws the snapshots' weights s from the actor's (default 0.5),
    and the result then holds the old and reference log-probs, the weights after the last
    step, the tokens each model forward's embedding was handed and each planned pass's figures."""
    with lane_rank(rank, world_size, pipeline=pipeline, context=context, tensor=tensor, virtual=virtual,
                   expert=expert) as patch:
        import slime_kit as kit
        from megatron.core import parallel_state
        from slime.backends.megatron_utils import model as slime_model
        from slime.observability.profile_utils import TrainProfiler
        from slime.observability.timer import Timer

        import megatron_rl_patches
        from megatron_rl_patches.integrations.megatron.opd.opd_settings import opd_settings
        from megatron_rl_patches.integrations.megatron.opd.privileged import PrivilegedTeacher, StudentChunksPass
        from megatron_rl_patches.integrations.megatron.opd.served_opd import ServedOpdTeacher
        from megatron_rl_patches.integrations.megatron.opd.topk_request import FIGURES as TEACHER_FIGURES
        from megatron_rl_patches.integrations.megatron.opd.topk_request import (
            STEP_SAME_AS,
            TEACHER_HEADS,
            TEACHER_HIDDEN,
        )
        from megatron_rl_patches.integrations.slime import opd as slime_opd

        for name, value in OPD_ENV.items():
            patch.setenv(f"MEGATRON_RL_PATCHES_OPD_{name}", value)
        if hf_teacher is not None:  # on the actor's own --spec core attention (hf_teachers.packed_core_attention)
            patch.setenv("MEGATRON_RL_PATCHES_OPD_TEACHERS", f"teacher-a,{hf_teacher}")
            if context > 1:  # the actor keeps the lane's context-parallel core, the teachers the kit's (zigzag)
                from megatron_rl_patches.integrations.megatron.opd import hf_teachers
                from megatron_rl_patches.testing.cp_attention import ContextParallelAttention

                patch.setattr(hf_teachers, "packed_core_attention", lambda args: ContextParallelAttention)
            else:
                flags = (*flags, *ACTOR_SPEC)
        if weights is not None:
            patch.setenv("MEGATRON_RL_PATCHES_OPD_WEIGHTS", weights)
        if wide_path is not None:
            patch.setenv("MEGATRON_RL_PATCHES_OPD_TEACHERS", f"teacher-a,{wide_path}@slime_ranks:wide_teacher")
        cross_flags: tuple[str, ...] = ()
        if cross is not None:
            from megatron_rl_patches.integrations.megatron.opd import hf_teachers
            from megatron_rl_patches.testing.packed_gpt import packed_attention_class

            patch.setenv("MEGATRON_RL_PATCHES_OPD_TEACHERS",
                         cross.get("entries", f"teacher-a,{cross['teacher']};tokenizer=own"))
            patch.setenv("MEGATRON_RL_PATCHES_OPD_WEIGHTS", cross.get("weights", OPD_ENV["WEIGHTS"]))
            # the teacher's layers on the kit's CPU attention: packed, or context-parallel (zigzag) at CP > 1
            from megatron_rl_patches.testing.cp_attention import ContextParallelAttention

            core = ContextParallelAttention if context > 1 else packed_attention_class()
            patch.setattr(hf_teachers, "packed_core_attention", lambda args: core)
            cross_flags = ("--vocab-size", str(cross["vocab"]))
        if served is not None:
            patch.setenv("MEGATRON_RL_PATCHES_OPD_TEACHERS", served["entries"])
            patch.setenv("MEGATRON_RL_PATCHES_OPD_IDS_FROM", served.get("ids_from", "teacher"))
        for name, value in (env or {}).items():
            patch.setenv(f"MEGATRON_RL_PATCHES_OPD_{name}", value)
        extra = extra or {}
        if extra.get("shared_prefix"):
            patch.setenv("MEGATRON_RL_PATCHES_SHARED_PREFIX", "1")
        passes: list[tuple[str, dict]] = []  # each planned pass's figures, as it logs them
        from megatron_rl_patches.integrations.megatron import shared_prefix_pass

        real_log = shared_prefix_pass.PrefixPass.log
        patch.setattr(shared_prefix_pass.PrefixPass, "log",
                      lambda self: (passes.append((self.what, dict(self.figures))), real_log(self))[1])
        agreed: list[int] = []  # the teacher micro-batch counts agreed (with expert parallelism)
        if cross is not None and cross.get("more_micro_batches"):
            from megatron_rl_patches.integrations.megatron.opd import expert_agreement

            def more(count: int, real: Any = expert_agreement.agreed_micro_batches) -> int:
                agreed.append(real(count) + cross["more_micro_batches"])  # as if another rank planned more
                return agreed[-1]

            patch.setattr(expert_agreement, "agreed_micro_batches", more)
        megatron_rl_patches.apply(only=["train_reentry", "slime_fused", "gpt_output_processor", "slime_opd"])
        try:
            with kit.slime_session("--pipeline-model-parallel-size", str(pipeline), "--context-parallel-size",
                                   str(context), "--tensor-model-parallel-size", str(tensor), "--loss-type",
                                   "custom_loss", "--custom-loss-function-path", OPD_LOSS, *virtual_args(virtual),
                                   *flags, *cross_flags,
                                   **({"hf_checkpoint": cross["student"]} if cross else {}),
                                   **({"hf_checkpoint": served["student"]} if served else {}),
                                   rollout_temperature=float(served.get("temperature", 1.0)) if served
                                   else (cross or {}).get("temperature", TEMPERATURE),
                                   log_probs_chunk_size=4,
                                   use_critic=False,  # what slime_validate_args sets
                                   **_whole_gradients(world_size // (pipeline * tensor)),  # EP=2: DP=2 here
                                   **(MOE_VALUES if expert > 1 else {})) as args:
                if args.allgather_cp:
                    declared_dsa(args)
                model, optimizer, scheduler = kit.build(args)
                actor = kit.actor(args, model, {"teacher-a": 1, "teacher-b": 2, "reference": 3,
                                                **(cross or {}).get("seeds", {})}, patch,
                                  (extra or {}).get("snapshot_scale", 0.5))
                if extra.get("ref"):
                    actor.load_other_checkpoint("ref", "reference")
                    actor._switch_model("actor")
                embedded: list[int] = []  # the ids each forward of the actor's first chunk embedded
                if parallel_state.is_pipeline_first_stage():
                    from megatron_rl_patches.integrations.megatron.model_chunk import unwrap

                    unwrap(model[0]).embedding.register_forward_pre_hook(
                        lambda m, a, k: embedded.append(int((k.get("input_ids", a[0] if a else None)).numel())),
                        with_kwargs=True)
                teachers = slime_opd.load_teachers(actor, opd_settings())
                setattr(actor, slime_opd.ATTRIBUTE, teachers)
                # a teacher with another tokenizer: its model; a served teacher has none in this process
                remote = (ServedOpdTeacher, StudentChunksPass)  # the live self-teacher: the actor's own chunks
                inner = [t.teacher if isinstance(t, PrivilegedTeacher) else t for t in teachers]
                models = [getattr(t, "model", t) for t in inner if not isinstance(t, remote)]
                separate = [_stage_state(t) for t in models if not isinstance(t, str)]
                actor.prof, actor.rollout_data_postprocess = TrainProfiler(args), None
                actor.optimizer, actor.opt_param_scheduler = optimizer, scheduler
                actor.weight_updater = type("NoServer", (), {"pop_metrics": staticmethod(dict)})()
                Timer().start("train_wait")  # what slime's init leaves running (its with_defer)
                states = {}
                for tag in [*(t for t in models if isinstance(t, str)), "actor"]:
                    actor._switch_model(tag)
                    states[tag] = _stage_state(model)
                if wide_path is not None:  # the separate teacher's own chunks
                    states["opd_teacher_1"] = separate[0]
                samples = (cross or {}).get("samples") or (served or {}).get("rollouts") or extra.get("rollouts")
                carried = contexts if contexts is not None else (served or {}).get("contexts")

                def rollout_of(rollout_id: int) -> dict:
                    data = actor_rollout(rollout_id, samples)
                    if carried is not None:
                        from megatron_rl_patches.integrations.megatron.opd.topk_request import CONTEXTS

                        data[CONTEXTS] = carried  # as slime_opd's split carries each sample's train_metadata
                    return data

                data = rollout_of(0)
                Timer().seq_lens = data["total_lengths"]  # what slime's process_rollout_data notes
                grads = first_grads(patch, optimizer, model)
                losses: list[dict] = []
                train_one_step = slime_model.train_one_step

                def noting_losses(*a, **k):
                    result = train_one_step(*a, **k)
                    losses.append(dict(result[0]))
                    return result

                patch.setattr(slime_model, "train_one_step", noting_losses)
                mtp_losses = noting_mtp_losses(patch) if args.enable_mtp_training else None
                expert_counts = noting_expert_counts(patch) if extra and args.num_experts else None
                seconds = [time.perf_counter()]
                actor.train_actor(0, data)
                seconds.append(time.perf_counter())
                first = data
                figures = [data.get(TEACHER_FIGURES)]
                for rollout_id in range(1, rollouts):  # re-entry: slime's train() and the teacher passes again
                    data = rollout_of(rollout_id)
                    actor.train_actor(rollout_id, data)
                    seconds.append(time.perf_counter())
                    figures.append(data.get(TEACHER_FIGURES))
                last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
                return {"states": states, "grads": grads, "losses": losses if last else None,
                        "step_seconds": [b - a for a, b in zip(seconds, seconds[1:])],
                        "opd_reverse_kl": first.get("opd_reverse_kl"),  # slime's --use-opd advantage term
                        "ids": first.get(slime_opd.IDS), "ids_mask": first.get(slime_opd.IDS_MASK),
                        "rows": _response_rows(first),
                        "teacher_logprobs": first.get(slime_opd.TEACHER_LOGPROBS),
                        "served_logprobs": None if first.get(slime_opd.TEACHER_LOGPROBS) is None else
                        [values[0] for values in first[slime_opd.TEACHER_LOGPROBS]],  # the first teacher's
                        "second_logprobs": None if first.get(slime_opd.TEACHER_LOGPROBS) is None else
                        [values[-1] for values in first[slime_opd.TEACHER_LOGPROBS]],  # the last teacher's
                        "last_ids": data.get(slime_opd.IDS),
                        # K=vocab: per sample each teacher's hidden states, and the teachers' output weights
                        "teacher_hidden": first.get(TEACHER_HIDDEN),
                        "teacher_heads": first[TEACHER_HEADS][0].weights if first.get(TEACHER_HEADS) else None,
                        "teacher_micro_batches": agreed,
                        "teacher_figures": first.get(TEACHER_FIGURES),  # the served teachers' step metrics
                        "figures_per_step": figures,
                        "step_repeats": sum(int((same_as >= 0).sum()) for same_as in first.get(STEP_SAME_AS, [])),
                        # the step's OPD fields (the teachers' figures apart: "teacher_figures")
                        "keys": sorted(k for k in data if k.startswith("opd_") and k != TEACHER_FIGURES),
                        "split": _partition_dims(model),
                        "active": actor._active_model_tag,
                        "old_log_probs": first.get("log_probs"), "ref_log_probs": first.get("ref_log_probs"),
                        "updated": _stage_state(model) if extra else None, "embedded": embedded,
                        "prefix_passes": passes, "mtp_losses": mtp_losses if last else None,
                        **(moe_statistics(model) if extra and args.num_experts else {}), "expert_counts": expert_counts,
                        "hf_layers": [[layer.layer_number for layer in chunk.decoder.layers]
                                      for t in models if not isinstance(t, str) for chunk in t]}
        finally:
            megatron_rl_patches.revert()


def noting_mtp_losses(patch: Any) -> list[Any]:
    """Filled with the MTP loss per depth of every step, as slime's train() reads megatron's tracker
    (after its reductions, before it cleans the tracker)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    noted: list[Any] = []
    clean = MTPLossLoggingHelper.clean_loss_in_tracker

    def noting() -> None:
        values = MTPLossLoggingHelper.tracker.get("values")
        if values is not None:
            noted.append(values.clone())
        clean()

    patch.setattr(MTPLossLoggingHelper, "clean_loss_in_tracker", staticmethod(noting))
    return noted


def noting_expert_counts(patch: Any) -> list[Any]:
    """Filled at each step with the tokens-per-expert counts (all layers, summed over the step's
    micro-batches and the tensor- and data-parallel ranks) that megatron's update moves the expert
    bias by (`finalize_model_grads`)."""
    import importlib

    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    noted: list[Any] = []
    update = finalize.get_updated_expert_bias

    def noting(tokens_per_expert: Any, expert_bias: Any, rate: float) -> Any:
        updated = update(tokens_per_expert, expert_bias, rate)
        noted.append(tokens_per_expert.clone())  # all-reduced in place by the update
        return updated

    patch.setattr(finalize, "get_updated_expert_bias", noting)
    return noted


def moe_statistics(model: list[Any]) -> dict[str, Any]:
    """After the steps: every router's expert bias (megatron's update from the tokens-per-expert
    counts) and the MoE losses megatron-core tracked per layer (summed over the steps; slime never
    clears the tracker)."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    bias = {name: b.detach().clone() for chunk in model for name, b in chunk.named_buffers()
            if name.endswith("expert_bias")}
    tracked = {name: entry["values"].detach().clone() for name, entry in get_moe_layer_wise_logging_tracker().items()
               if isinstance(entry, dict) and entry.get("values") is not None}
    return {"expert_bias": bias, "moe_losses": tracked}


FUSED = ["slime_fused", "gpt_output_processor"]


def _old_log_probs(args: Any, data: dict, log_probs: list[Any]) -> dict:
    """The rollout again with slime's log-probs (shifted) as its old log-probs, and the advantages
    in the rows this rank's log-probs hold (slime's actor slices them so with context parallelism)."""
    import slime_kit as kit
    from slime.backends.megatron_utils.cp_utils import slice_log_prob_with_cp

    step = kit.rollout(0, [lp + 0.05 for lp in log_probs])
    step["advantages"] = [slice_log_prob_with_cp(a, total, response) for a, total, response in
                          zip(step["advantages"], data["total_lengths"], data["response_lengths"])]
    return step


# An MoE student at EP=2: slime's validate_args turns the allgather dispatcher into alltoall (for
# variable sequence lengths); the alltoall dispatcher's split-size all_to_all does not run on gloo,
# so the lane sets allgather back after slime's validation (MOE_VALUES), with the kit's CPU router shim;
# megatron-core refuses allgather with variable sequence lengths, which only size the pipeline's
# sends (this world has one stage), so they are off too.
EP2 = BY_MARKER["ep2"].megatron_lm_args  # testing/layouts.py
MOE_VALUES = {"moe_token_dispatcher_type": "allgather", "variable_seq_lengths": False}


def fused_and_plain(rank: int, world_size: int, pipeline: int = 1, context: int = 1, tensor: int = 1,
                    flags: tuple[str, ...] = (), expert: int = 1, virtual: int | None = None) -> dict[str, Any]:
    """slime's real forward_only (log-probs, entropy) and train_one_step (losses, this rank's
    reduced gradients) from the same fresh weights, unpatched and with slime_fused, at the layout
    (every data-parallel rank holds the whole rollout; `virtual` model chunks per pipeline rank)."""
    with lane_rank(rank, world_size, pipeline=pipeline, context=context, tensor=tensor, virtual=virtual,
                   expert=expert) as patch:
        import slime_kit as kit
        from megatron.core import parallel_state
        from slime.backends.megatron_utils import model as slime_model

        import megatron_rl_patches

        routes: dict[str, Any] = {}
        for route in ("plain", "fused"):
            if route == "fused":
                megatron_rl_patches.apply(only=FUSED)
            try:
                with kit.slime_session("--pipeline-model-parallel-size", str(pipeline), "--context-parallel-size",
                                       str(context), "--tensor-model-parallel-size", str(tensor),
                                       *virtual_args(virtual), *flags,
                                       rollout_temperature=TEMPERATURE, use_rollout_entropy=True, entropy_coef=0.01,
                                       log_probs_chunk_size=4, **_whole_gradients(context),
                                       **(MOE_VALUES if expert > 1 else {})) as args:
                    if args.allgather_cp:
                        declared_dsa(args)
                    model, optimizer, scheduler = kit.build(args)
                    data = kit.rollout(0)
                    out = kit.log_probs(args, model, data)
                    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
                    step = _old_log_probs(args, data, out["log_probs"]) if last else kit.rollout(0)
                    for chunk in model:
                        chunk.train()
                    grads = first_grads(patch, optimizer, model)
                    data_parallel = parallel_state.get_data_parallel_world_size()
                    losses, grad_norm = slime_model.train_one_step(args, 0, 0, kit.iterators(step, len(model)), model,
                                                                   optimizer, scheduler, 2, 4 * data_parallel)
                    routes[route] = {"dispatcher": args.moe_token_dispatcher_type,
                                     "log_probs": out.get("log_probs"), "entropy": out.get("entropy"),
                                     "losses": {k: float(v) for k, v in losses.items()}, "grad_norm": grad_norm,
                                     "grads": grads, "params": {name: p.dtype for name, p in _named(model).items()}}
            finally:
                megatron_rl_patches.revert()
        return routes
