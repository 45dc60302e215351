"""The slime lane's kit: slime's own arguments (Megatron-LM's parser with slime's extra-args
provider), slime's `setup_model_and_optimizer` (real DDP and distributed optimizer) around the
test kit's packed tiny GPT, a rollout as slime's actor hands it to `train()` / `forward_only`, and
float64 references. The only substitution: slime's model provider (it builds from an HF config
with Transformer Engine specs) is the packed tiny GPT."""
from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator, Sequence
from typing import Any
from unittest import mock

import torch

VOCAB = 64
SEQ = 64
PROMPTS = (5, 7, 4, 6)  # prompt lengths of the 4 samples of a rollout
RESPONSES = (6, 3, 8, 5)

ARGV: tuple[str, ...] = (
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", str(SEQ),
    "--max-position-embeddings", str(SEQ), "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "0.01",
    "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--transformer-impl", "local",
    "--use-cpu-initialization", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
    "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--attention-dropout", "0",
    "--hidden-dropout", "0", "--position-embedding-type", "rope", "--distributed-backend", "gloo",
    "--vocab-size", str(VOCAB), "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "3",
    "--hf-checkpoint", "none", "--load", "none", "--data-pad-size-multiplier", "1", "--no-rope-fusion",
)  # fmt: skip


def slime_args(*extra: str, **values: Any) -> Any:
    """slime's argument namespace (Megatron-LM's parse_args with slime's provider, then slime's
    Megatron validate_args: Megatron-LM's own and slime's additions, e.g. variable sequence lengths)."""
    from megatron.training import arguments
    from megatron.training.arguments import parse_args
    from slime.backends.megatron_utils.arguments import validate_args  # Megatron-LM's, then slime's (varlen)
    from slime.utils.arguments import get_slime_extra_args_provider

    with mock.patch.object(sys, "argv", ["slime-lane", *ARGV, *extra]):
        args = parse_args(extra_args_provider=get_slime_extra_args_provider())
    # Megatron-LM asks the GPU's architecture when TP or CP > 1 (CPU: Hopper's answer, for this call only)
    with mock.patch.object(arguments, "get_device_arch_version", lambda: 9):
        validate_args(args)
    args.padded_vocab_size = args.vocab_size
    args.eps_clip_high = args.eps_clip if args.eps_clip_high is None else args.eps_clip_high  # slime_validate_args
    for name, value in values.items():
        setattr(args, name, value)
    return args


@contextlib.contextmanager
def slime_session(*extra: str, **values: Any) -> Iterator[Any]:
    """Megatron-LM's globals set from slime's arguments (torn down on exit); yields the args."""
    from megatron.core import num_microbatches_calculator
    from megatron.training import global_vars

    args = slime_args(*extra, **values)
    global_vars.set_global_variables(args, build_tokenizer=False)
    try:
        yield args
    finally:
        global_vars.destroy_global_vars()
        num_microbatches_calculator.destroy_num_microbatches_calculator()


def provider_func(args: Any, role: str = "actor") -> Any:
    """Stands for slime's `get_model_provider_func`: the packed tiny GPT, config and sizes from args."""
    from megatron.training.arguments import core_transformer_config_from_args

    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    def provider(pre_process: bool = True, post_process: bool = True, vp_stage: Any = None, config: Any = None,
                 **_: Any) -> Any:
        config = config if config is not None else core_transformer_config_from_args(args)
        if args.multi_latent_attention:
            return latent_gpt(args, config, pre_process, post_process, vp_stage)
        if args.mtp_num_layers:
            return mtp_gpt(args, config, pre_process, post_process, vp_stage)
        layout = None  # slime's get_batch: zigzag thd, or with --allgather-cp the stream's contiguous slices
        if args.context_parallel_size > 1:
            layout = "contiguous" if args.allgather_cp else "zigzag"
        return build_packed_gpt(vocab_size=args.padded_vocab_size, seq_length=args.max_position_embeddings, seed=0,
                                config=config, pre_process=pre_process, post_process=post_process,
                                context_parallel_layout=layout, vp_stage=vp_stage,
                                position_embedding_type=args.position_embedding_type)

    return provider


def packed_spec(args: Any, config: Any, vp_stage: Any = None) -> Any:
    """The actor's custom local spec as slime reads `--spec slime_kit packed_spec` (it calls the
    function with args, config and the virtual stage): the kit's packed-input layer spec."""
    from megatron_rl_patches.testing.packed_gpt import packed_gpt_spec

    return packed_gpt_spec(args.num_experts)


def mtp_gpt(args: Any, config: Any, pre_process: bool, post_process: bool, vp_stage: Any) -> Any:
    """The packed tiny GPT with `args.mtp_num_layers` MTP heads (megatron's MTP block spec over the
    same packed-attention layer spec), as slime's provider builds MTP students."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_rl_patches.testing.packed_gpt import packed_gpt_spec

    torch.manual_seed(0)
    spec = packed_gpt_spec()
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings, position_embedding_type="rope",
                    pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
                    mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False))


def latent_gpt(args: Any, config: Any, pre_process: bool, post_process: bool, vp_stage: Any) -> Any:
    """A DeepSeek-shaped tiny GPT from slime's arguments: multi-latent attention on the kit's packed
    core (megatron-core's local MLA layer spec), an MoE MLP of `args.num_experts` experts where set,
    and `args.mtp_num_layers` MTP heads mirroring that layer."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_rl_patches.inference.loading.hf.families.mla import disarm_mocked_te_in_mla
    from megatron_rl_patches.testing.packed_gpt import packed_attention_class

    disarm_mocked_te_in_mla()
    spec = get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=False, multi_latent_attention=True,
                                    qk_layernorm=args.qk_layernorm, normalization=args.normalization)
    spec.submodules.self_attention.submodules.core_attention = packed_attention_class()
    mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if args.mtp_num_layers else None
    torch.manual_seed(0)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings, position_embedding_type="rope",
                    pre_process=pre_process, post_process=post_process, vp_stage=vp_stage, mtp_block_spec=mtp)


def build(args: Any) -> tuple[list[Any], Any, Any]:
    """slime's own `setup_model_and_optimizer(args, "actor")` on the tiny GPT."""
    from slime.backends.megatron_utils import model as slime_model

    with mock.patch.object(slime_model, "get_model_provider_func", provider_func):
        return slime_model.setup_model_and_optimizer(args, "actor")


def rollout(seed: int, old_log_probs: Sequence[torch.Tensor] | None = None, *, prompts: Sequence[int] = PROMPTS,
            responses: Sequence[int] = RESPONSES, vocab: int = VOCAB,
            micro_batches: Sequence[Sequence[int]] = ((0, 1), (2, 3))) -> dict[str, Any]:
    """One rollout's per-sample data as slime's actor passes it to train(): tokens, masks
    (one masked response token per sample), advantages, old log-probs; by default 4 samples in
    2 micro-batches of 2."""
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, vocab, (p + r,), generator=gen) for p, r in zip(prompts, responses)]
    masks = []
    for r in responses:
        mask = torch.ones(r, dtype=torch.int)
        mask[r // 2] = 0
        masks.append(mask)
    data = {
        "tokens": tokens,
        "total_lengths": [p + r for p, r in zip(prompts, responses)],
        "response_lengths": list(responses),
        "loss_masks": masks,
        "advantages": [torch.randn(r, generator=gen) for r in responses],
        "micro_batch_indices": [list(indices) for indices in micro_batches],
    }
    if old_log_probs is not None:
        data["log_probs"] = list(old_log_probs)
    return data


def iterators(data: dict, chunks: int = 1) -> list[Any]:
    """slime's data iterators, one per model chunk of this rank (virtual pipeline stages)."""
    from slime.backends.megatron_utils.data import DataIterator

    return [DataIterator(data, data["micro_batch_indices"]) for _ in range(chunks)]


def log_probs(args: Any, model: list[Any], data: dict) -> dict[str, list[torch.Tensor]]:
    """slime's real `forward_only(get_log_probs_and_entropy, ...)` over the rollout."""
    from slime.backends.megatron_utils import loss as slime_loss
    from slime.backends.megatron_utils import model as slime_model

    return slime_model.forward_only(slime_loss.get_log_probs_and_entropy, args, model, iterators(data, len(model)),
                                    [len(data["micro_batch_indices"])])


def train(args: Any, rollout_id: int, model: list[Any], optimizer: Any, scheduler: Any, data: dict) -> None:
    """slime's real `train()` for one step over the rollout's micro-batches."""
    from slime.backends.megatron_utils import model as slime_model

    slime_model.train(rollout_id, model, optimizer, scheduler, iterators(data), [len(data["micro_batch_indices"])],
                      [len(data["tokens"])])


def reference(model: list[Any], data: dict, temperature: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """float64 log p(response token) and entropy per sample from the model's logits, one sample at
    a time with the output layer in float64."""
    from megatron_rl_patches.testing.megatron_cpu import gpt_forward  # noqa: F401  (kit import check)

    gpt = model[0]
    while hasattr(gpt, "module"):
        gpt = gpt.module
    log_probs, entropies = [], []
    captured: dict[str, torch.Tensor] = {}
    handle = gpt.output_layer.register_forward_hook(lambda m, i, o: captured.__setitem__("h", i[0]))
    try:
        with torch.no_grad():
            for tokens, response in zip(data["tokens"], data["response_lengths"]):
                n = tokens.numel()
                causal = torch.ones(n, n, dtype=torch.bool).tril().logical_not()[None, None]
                gpt(tokens[None], torch.arange(n)[None], causal)
                hidden = captured["h"][:, 0].double()
                logits = hidden @ gpt.output_layer.weight.double().T / temperature
                logp = torch.log_softmax(logits, dim=-1)[n - response - 1: n - 1]
                log_probs.append(logp.gather(-1, tokens[n - response:, None])[:, 0])
                entropies.append(-(logp.exp() * logp).sum(-1))
    finally:
        handle.remove()
    return log_probs, entropies


def actor(args: Any, model: list[Any], teachers: dict[str, int], monkeypatch: Any, scale: float = 0.5) -> Any:
    """slime's `MegatronTrainRayActor` with what its `init` sets for training (args, model, the
    weight snapshots of slime's TensorBackuper, active tag "actor"); its checkpoint reader gives
    each teacher path the tiny GPT's weights from that path's seed (the lane has no checkpoints):
    the actor's own moved by `scale` times a standard normal draw."""
    from slime.backends.megatron_utils import actor as slime_actor
    from slime.backends.megatron_utils.update_weight.common import named_params_and_buffers
    from slime.utils.tensor_backper import TensorBackuper

    def load_checkpoint(chunks: list[Any], *_: Any, **__: Any) -> tuple[int, int]:
        gen = torch.Generator().manual_seed(teachers[args.load])
        with torch.no_grad():
            for p in (p for chunk in chunks for p in chunk.parameters()):  # every virtual-pipeline chunk
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)
        return 0, 0

    monkeypatch.setattr(slime_actor, "load_checkpoint", load_checkpoint)
    instance = slime_actor.MegatronTrainRayActor.__new__(slime_actor.MegatronTrainRayActor)
    instance.args, instance.model, instance.role = args, model, "actor"
    instance.weights_backuper = TensorBackuper.create(
        source_getter=lambda: named_params_and_buffers(args, model, convert_to_global_name=True), single_tag=None)
    instance._active_model_tag = "actor"
    instance.weights_backuper.backup("actor")
    return instance


def float64_copy(args: Any, values: list[torch.Tensor]) -> Any:
    """The tiny GPT in float64 holding `values` (its parameters in order)."""
    module = provider_func(args)().double()
    with torch.no_grad():
        for p, value in zip(module.parameters(), values):
            p.copy_(value)
    return module


def response_logps(module: Any, data: dict, temperature: float, vocab: int | None = None) -> list[torch.Tensor]:
    """Per sample, the dense [R, V] log-softmax (logits / temperature) at the response's rows
    (`vocab`: over the first `vocab` ids only, a Hugging Face model's real ones)."""
    out = []
    for tokens, response in zip(data["tokens"], data["response_lengths"]):
        n = tokens.numel()
        causal = torch.ones(n, n, dtype=torch.bool).tril().logical_not()[None, None]
        logits = module(tokens[None], torch.arange(n)[None], causal)[0].double()[:, :vocab] / temperature
        out.append(torch.log_softmax(logits, dim=-1)[n - response - 1: n - 1])
    return out


def student_and_snapshot(args: Any, states: dict[str, dict[str, torch.Tensor]], data: dict,
                         temperature: float) -> tuple[Any, list[torch.Tensor]]:
    """From the ranks' gathered states (whole-model names): the student in float64 (autograd, its
    parameters named as `states["actor"]`) and the snapshot teacher's (`opd_teacher_0`) per-sample
    dense log-softmaxes."""
    names = [name for name, _ in provider_func(args)().named_parameters()]
    assert sorted(names) == sorted(states["actor"])
    student = float64_copy(args, [states["actor"][name] for name in names])
    with torch.no_grad():
        snapshot = response_logps(float64_copy(args, [states["opd_teacher_0"][name] for name in names]), data,
                                  temperature)
    return student, snapshot


def hf_teacher_logps(path: str, data: dict, temperature: float, vocab: int | None) -> list[torch.Tensor]:
    """Per sample, the Hugging Face teacher at `path` (built alone, one rank, in float64) as a dense
    log-softmax at the response rows over its first `vocab` ids (None: all, padding rows too)."""
    from megatron_rl_patches.inference.build_hf import build_inference_model_from_hf

    (teacher,) = build_inference_model_from_hf(path, dtype=torch.float32)
    teacher = teacher.double()
    out = []
    with torch.no_grad():
        for tokens, response in zip(data["tokens"], data["response_lengths"]):
            n = tokens.numel()
            causal = torch.ones(n, n, dtype=torch.bool).tril().logical_not()[None, None]
            logits = teacher(tokens[None], torch.arange(n)[None], causal)[0].double()[:, :vocab] / temperature
            out.append(torch.log_softmax(logits, dim=-1)[n - response - 1: n - 1])
    return out


def hf_teacher_token_logps(path: str, data: dict, temperature: float) -> list[torch.Tensor]:
    """Per sample, log p(response token) at `temperature` from the Hugging Face teacher at `path`
    built alone in float64, one unpacked sample at a time (over the kit's VOCAB ids)."""
    logps = hf_teacher_logps(path, data, temperature, VOCAB)
    return [logp.gather(-1, tokens[-len(logp):, None])[:, 0] for logp, tokens in zip(logps, data["tokens"])]


ROLE_NO_PADDING = ("--make-vocab-size-divisible-by", "64")  # a 64-id teacher unpadded: every logit is real


def prm_role_log_probs(path: str, roles: str, monkeypatch: Any, temperature: float,
                       *flags: str, seed: int = 0) -> tuple[list[torch.Tensor], Any]:
    """The `prm_teacher` role from the Hugging Face directory `path`, built by slime's real
    initialize_model_and_optimizer under MEGATRON_RL_PATCHES_INFERENCE_ROLES=`roles` (inference-only:
    no optimizer, no parameter requiring grad), then slime's forward_only log-probs over the kit's
    packed rollout of `seed`; and the role's model, unwrapped."""
    from slime.backends.megatron_utils import model as slime_model

    monkeypatch.setenv("MEGATRON_RL_PATCHES_INFERENCE_ROLES", roles)
    with slime_session(*ROLE_NO_PADDING, *flags, rollout_temperature=temperature, prm_teacher_load=path) as args:
        model, optimizer, scheduler, iteration = slime_model.initialize_model_and_optimizer(args, role="prm_teacher")
        assert optimizer is None and scheduler is None and iteration == 0 and model[0].role == "prm_teacher"
        assert not any(p.requires_grad for p in model[0].parameters())
        inner = model[0]
        while hasattr(inner, "module"):
            inner = inner.module
        return log_probs(args, model, rollout(seed))["log_probs"], inner


def dense_topk_opd(args: Any, model: list[Any], snapshots: list[Any], data: dict,
                   ids: list[torch.Tensor], weights: Sequence[float], temperature: float,
                   masks: Sequence[torch.Tensor] | None = None) -> tuple[torch.Tensor, Any]:
    """float64 reference of the first step's OPD loss (forward KL of the teachers' mixture to the
    student over the k+1 buckets, mean over each sample's unmasked tokens, / samples) from dense
    [R, V] log-softmaxes; the student in float64 with autograd (its .grad are filled). `masks`
    (per sample, ids' shape): only the True ids are buckets, the rest of the mass is the tail."""
    gpt = model[0]
    while hasattr(gpt, "module"):
        gpt = gpt.module
    student = float64_copy(args, [p.detach() for p in gpt.parameters()])
    teachers = []
    for snapshot in snapshots:  # a snapshot of the actor's parameters, or a float64 teacher module
        with torch.no_grad():
            module = float64_copy(args, snapshot) if isinstance(snapshot, list) else snapshot
            teachers.append(response_logps(module, data, temperature))
    total = dense_opd_loss(response_logps(student, data, temperature), teachers, data, ids, weights, masks)
    total.backward()
    return total, student


def dense_opd_loss(students: list[torch.Tensor], teachers: list[list[torch.Tensor]], data: dict,
                   ids: list[torch.Tensor], weights: Sequence[float],
                   masks: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """The first step's OPD loss (as `dense_topk_opd`) from per-sample dense [R, V] log-softmaxes:
    the student's and, per teacher, its own (any model: a snapshot or another architecture)."""
    w = torch.tensor(weights, dtype=torch.float64)
    w = w / w.sum()
    total = torch.zeros((), dtype=torch.float64)
    for s, (sample_ids, mask) in enumerate(zip(ids, data["loss_masks"])):
        real = torch.ones_like(sample_ids, dtype=torch.bool) if masks is None else masks[s]
        buckets = []
        for logp in [students[s], *[t[s] for t in teachers]]:
            at = logp.gather(-1, sample_ids.clamp(min=0)).masked_fill(~real, -math.inf)
            buckets.append(torch.cat([at, torch.log1p(-at.exp().sum(-1, keepdim=True).clamp(max=1 - 1e-15))], -1))
        mix = torch.log((w[:, None, None] * torch.stack([b.exp() for b in buckets[1:]])).sum(0))
        kl = torch.where(mix.isneginf(), 0.0, mix.exp() * (mix - buckets[0])).sum(-1)  # 0·log 0 = 0
        total = total + (kl * mask).sum() / mask.sum().clamp(min=1)
    return total / len(ids)


def dense_vocab_loss(students: list[torch.Tensor], teachers: list[list[torch.Tensor]], data: dict,
                     weights: Sequence[float]) -> torch.Tensor:
    """The first step's full-vocabulary OPD loss (MEGATRON_RL_PATCHES_OPD_K=vocab, forward KL) from
    per-sample dense [R, V] log-softmaxes: KL(q_mix ‖ p_s) per token over the whole vocabulary
    (q_mix mixed in probability space), averaged over each sample's loss mask, then over samples."""
    log_w = torch.tensor(weights, dtype=torch.float64).log()[:, None, None]
    total = torch.zeros((), dtype=torch.float64)
    for s, mask in enumerate(data["loss_masks"]):
        mix = torch.logsumexp(torch.stack([t[s] for t in teachers]) + log_w, dim=0)
        kl = (mix.exp() * (mix - students[s])).sum(-1)
        total = total + (kl * mask).sum() / mask.sum().clamp(min=1)
    return total / len(students)


def whole_stages(stages: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The stages' named tensors (already under the whole model's names) in one dict."""
    whole: dict[str, torch.Tensor] = {}
    for stage in stages:
        assert not set(whole) & set(stage), sorted(set(whole) & set(stage))
        whole.update(stage)
    return whole


def unsplit(shards: list[dict[str, torch.Tensor]], split: dict[str, int | None]) -> dict[str, torch.Tensor]:
    """One stage's named tensors from its tensor-parallel ranks' shards (replicated ones: rank 0's)."""
    return {name: shards[0][name] if split[name] is None else torch.cat([s[name] for s in shards], split[name])
            for name in shards[0]}


def whole_ids(ranks: list[dict], context: int, tensor: int) -> list[torch.Tensor]:
    """Per sample, the [R, k] ids (or other per-row values) of the whole response from the last
    stage's context-parallel ranks (each holds its zigzag rows, listed by `rows`; its
    tensor-parallel ranks hold the same)."""
    last = ranks[-context * tensor::tensor]
    if context == 1:
        return last[0]["ids"]
    whole = []
    for pieces in zip(*(rank["ids"] for rank in last)):
        sample = len(whole)
        rows = [rank["rows"][sample] for rank in last]
        ids = torch.zeros((sum(map(len, rows)), pieces[0].shape[-1]), dtype=pieces[0].dtype)  # any per-row values
        covered = torch.zeros(ids.shape[0], dtype=torch.bool)
        for piece, at in zip(pieces, rows):
            ids[at] = piece
            covered[at] = True
        assert covered.all(), "the context-parallel ranks' rows do not cover the response"
        whole.append(ids)
    return whole
