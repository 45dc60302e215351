"""Helpers for the verl lane: verl's Megatron engine object around a tiny packed GPTModel, packed
batches as verl's trainer builds them, and float64 references.

The test modules import verl's modules at collection, before any apply(): verl's model registry
binds `fused_forward_model_engine` by name at import, and a wrapper bound there while patched
would outlive the registry's `reset()` between tests as an inert copy."""
from __future__ import annotations

import math
import types
from typing import Any

import torch

VOCAB = 512
LENGTHS = (23, 17)
# the layout worlds' actor batch: prompt and response lengths, sampling temperature, PPO entropy bonus
PROMPTS, RESPONSES = (6, 5), (17, 12)
TEMPERATURE = 0.7
ENTROPY_COEFF = 0.3
REL = 2e-5  # fp32 rounding: against verl's own fp32 path and against float64
CONTROL = 1e-3  # what a negative control must at least be off by


def nested(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.nested_tensor(rows, layout=torch.jagged)


def engine(use_fused_kernels: bool, tf_config: Any = None) -> Any:
    """verl's real MegatronEngineWithLMHead, with the attributes its forward_step reads.

    Built with `__new__`: `MegatronEngine.__init__` + `initialize()` need an HF checkpoint for
    HFModelConfig and build the model through mbridge (`verl.models.mcore.mbridge.AutoBridge`),
    which is not installed in this lane (megatron-bridge pins its own megatron-core)."""
    from verl.workers.config import McoreEngineConfig
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    eng = object.__new__(MegatronEngineWithLMHead)
    eng.engine_config = McoreEngineConfig(use_mbridge=True, use_fused_kernels=use_fused_kernels)
    eng.model_config = types.SimpleNamespace(
        hf_config=types.SimpleNamespace(architectures=["Qwen2ForCausalLM"]),
        tokenizer=types.SimpleNamespace(pad_token_id=0),
        mtp=types.SimpleNamespace(enable=False, enable_train=False),
    )
    eng.tf_config = tf_config
    eng.enable_routing_replay = False
    return eng


def batch(lengths=LENGTHS, vocab: int = VOCAB, temperature: float = 0.7, calculate_entropy: bool = True,
          seed: int = 0, use_fused_kernels: bool | None = None) -> Any:
    """A verl micro-batch (TensorDict): nested input_ids and loss_mask, per-sample temperature."""
    from verl.utils import tensordict_utils as tu

    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    extra = {"calculate_entropy": calculate_entropy}
    if use_fused_kernels is not None:
        extra["use_fused_kernels"] = use_fused_kernels
    return tu.get_tensordict(
        {"input_ids": nested(ids), "loss_mask": nested([torch.ones(n) for n in lengths]),
         "temperature": torch.full((len(lengths),), temperature)},
        extra,
    )


def forward_step(eng: Any, model: Any, micro_batch: Any) -> dict:
    """verl's real `MegatronEngineWithLMHead.forward_step` on one micro-batch: its output dict."""
    output, _ = eng.forward_step(iter([micro_batch]), model, None, eng.postprocess_micro_batch_func)
    return output


def reference(model: Any, micro_batch: Any, temperature: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """float64 log p(next token) and entropy per sequence, from the model's own logits (gathered
    over tensor parallelism) run one sequence at a time (no packing). The last position has no
    next token (verl's label there is a rolled filler its losses never read): compare [:-1]."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    log_probs, entropies = [], []
    for seq in micro_batch["input_ids"].unbind():
        n = seq.numel()
        causal = torch.ones(n, n, dtype=torch.bool).tril().logical_not()[None, None]
        logits = gather_from_tensor_model_parallel_region(model(seq[None], torch.arange(n)[None], causal))
        logits = logits[0].double() / temperature
        logp = torch.log_softmax(logits, dim=-1)
        log_probs.append(logp.gather(-1, torch.roll(seq, -1)[:, None])[:, 0])
        entropies.append(-(logp.exp() * logp).sum(-1))
    return log_probs, entropies


def rows(value: torch.Tensor) -> list[torch.Tensor]:
    """A verl nested [b, j] output as one tensor per sequence."""
    return list(value.unbind())


def distillation_config(topk: int, clamp: float | None = -10.0, **loss_fields: Any) -> Any:
    """verl's DistillationConfig for its top-k forward KL (`forward_kl_topk`, k = `topk`)."""
    from verl.workers.config import DistillationConfig, DistillationLossConfig

    try:
        return DistillationConfig(distillation_loss=DistillationLossConfig(
            loss_mode="forward_kl_topk", topk=topk, log_prob_min_clamp=clamp, **loss_fields))
    except Exception:  # a config class that needs more fields: verl only reads these
        return types.SimpleNamespace(distillation_loss=types.SimpleNamespace(
            topk=topk, log_prob_min_clamp=clamp, **loss_fields))


def rl_batch(prompts: tuple[int, ...], responses: tuple[int, ...], vocab: int = VOCAB, temperature: float = 0.7,
             seed: int = 0, ids: list[torch.Tensor] | None = None, **extra: Any) -> Any:
    """A verl actor micro-batch as its trainer builds it (`ray_trainer`'s `_update_actor`): the
    rollout's left-padded prompts and right-padded responses ([b, P + R] `input_ids`,
    `attention_mask`, `position_ids`; [b, R] `response_mask`, `old_log_probs`, `advantages`;
    `prompts` / `responses`) through verl's own `left_right_2_no_padding`, which nests
    `input_ids` / `position_ids` and sets `loss_mask` to the padded, response-aligned
    `response_mask` (no whole-sequence mask); the global-batch numbers verl's losses normalize by
    and `extra` non-tensor keys beside them. `ids`: each sample's prompt and response (random ids otherwise)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    gen = torch.Generator().manual_seed(seed)
    random = [torch.randint(0, vocab, (p + r,), generator=gen) for p, r in zip(prompts, responses)]
    ids = random if ids is None else ids
    # near a fresh model's log-probs (about -log V): PPO ratios inside and outside the clip range
    old = [-math.log(vocab) + 0.1 * torch.randn(r, generator=gen) for r in responses]
    advantages = [torch.randn(r, generator=gen) for r in responses]
    width, length = max(prompts), max(responses)
    padded = torch.zeros(len(ids), width + length, dtype=torch.long)
    attention = torch.zeros_like(padded)
    per_response = {name: torch.zeros(len(ids), length) for name in ("response_mask", "old_log_probs", "advantages")}
    for i, (sequence, p, r) in enumerate(zip(ids, prompts, responses)):
        padded[i, width - p:width + r] = sequence
        attention[i, width - p:width + r] = 1
        for name, rows in (("response_mask", torch.ones(r)), ("old_log_probs", old[i]), ("advantages", advantages[i])):
            per_response[name][i, :r] = rows
    batch = TensorDict({"input_ids": padded, "attention_mask": attention,
                        "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
                        "prompts": padded[:, :width], "responses": padded[:, width:],
                        "temperature": torch.full((len(ids),), temperature), **per_response}, batch_size=[len(ids)])
    batch = left_right_2_no_padding(batch)
    tu.assign_non_tensor(batch, **{"dp_size": 1, "batch_num_tokens": sum(responses), "global_batch_size": len(ids),
                                   "num_micro_batch": 1, **extra})
    return batch


def train_step(eng: Any, model: Any, micro_batch: Any, loss_function: Any, logits_processor_func: Any = None) -> tuple:
    """verl's real `forward_step` and then its `postprocess_micro_batch_func` with `loss_function`
    (as `forward_backward_batch` binds them): (model output, the loss megatron would backpropagate)."""
    import functools

    post = functools.partial(eng.postprocess_micro_batch_func, forward_only=False, loss_function=loss_function)
    output, finish = eng.forward_step(iter([micro_batch]), model, logits_processor_func, post)
    loss, _ = finish(output)
    return output, loss


def actor_config(entropy_coeff: float = 0.0) -> Any:
    """verl's Megatron actor config (PPO, token-mean) with `entropy_coeff`."""
    from verl.workers.config import McoreActorConfig

    return McoreActorConfig(strategy="megatron", ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=1,
                            use_dynamic_bsz=False, rollout_n=1, entropy_coeff=entropy_coeff)


def grads(model: Any, group: Any = None) -> dict:
    """Every parameter's gradient (summed over the process `group` when given); zeroes them."""
    from megatron_rl_patches.testing.compare import collect_grads

    return collect_grads(model, summed_over=group)


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the reference's largest magnitude."""
    return float((got.double() - want.double()).abs().max()) / max(float(want.double().abs().max()), 1e-30)


def response_rows(value: torch.Tensor, prompts: tuple[int, ...], last: bool = False) -> list[torch.Tensor]:
    """Per sequence of a nested [b, j] output, the rows verl's losses read (the response tokens,
    predicted from row P-1 on); the sequence's last row (no next token) only with `last`."""
    return [row[p - 1:] if last else row[p - 1:-1] for row, p in zip(value.unbind(), prompts)]
