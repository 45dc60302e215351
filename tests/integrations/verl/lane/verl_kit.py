"""Helpers for the verl lane: verl's Megatron engine object around a tiny packed GPTModel, packed
batches as verl's trainer builds them, and float64 references.

The test modules import verl's modules at collection, before any apply(): verl's model registry
binds `fused_forward_model_engine` by name at import, and a wrapper bound there while patched
would outlive the registry's `reset()` between tests as an inert copy."""
from __future__ import annotations

import types
from typing import Any

import torch

VOCAB = 512
LENGTHS = (23, 17)


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
    """float64 log p(next token) and entropy per sequence, from the model's own logits run one
    sequence at a time (no packing). The last position has no next token (verl's label there is
    a rolled filler its losses never read): compare positions [:-1]."""
    log_probs, entropies = [], []
    for seq in micro_batch["input_ids"].unbind():
        n = seq.numel()
        causal = torch.ones(n, n, dtype=torch.bool).tril().logical_not()[None, None]
        logits = model(seq[None], torch.arange(n)[None], causal)[0].double() / temperature
        logp = torch.log_softmax(logits, dim=-1)
        log_probs.append(logp.gather(-1, torch.roll(seq, -1)[:, None])[:, 0])
        entropies.append(-(logp.exp() * logp).sum(-1))
    return log_probs, entropies


def rows(value: torch.Tensor) -> list[torch.Tensor]:
    """A verl nested [b, j] output as one tensor per sequence."""
    return list(value.unbind())
