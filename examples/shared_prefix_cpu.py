"""A group's prompt once in a hand-written megatron-core loop (docs/shared-prefix.md): a GRPO batch
(groups of samples sharing a prompt) cut into micro-batches by the tokens the model will compute,
each micro-batch packed by shared prefix for a training step through megatron-core's real schedule,
against the same step with every sample packed whole.

    .venv/bin/python examples/shared_prefix_cpu.py [--groups 2] [--group-size 8] [--prompt 96] [--response 12]

(`.venv/bin/python`: the clone's environment, which `make venv` or `make demo` builds; run from the
clone's root.)

megatron-core runs on CPU through the test kit's shims (megatron_rl_patches.testing); on a GPU
machine, initialize Megatron as usual instead of entering `megatron_on_cpu()`.
"""
from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from typing import Any

import torch

from megatron_rl_patches import log_probs_and_entropy
from megatron_rl_patches.apps.quiet import hide_import_notes
from megatron_rl_patches.shared_prefix import (
    check_shared_prefix,
    plan_shared_prefix,
    prepare_shared_prefix,
    shared_prefix_micro_batches,
    shared_prefix_params,
)
from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu, tiny_gpt_config
from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

VOCAB = 64


def grpo_samples(groups: int, size: int, prompt: int, response: int, seed: int = 0) -> list[dict]:
    """`groups` prompts, each with `size` sampled responses and their advantages."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(groups):
        shared = torch.randint(0, VOCAB, (prompt,), generator=gen)
        for _ in range(size):
            length = int(torch.randint(response // 2, response + 1, (1,), generator=gen))
            tokens = torch.cat([shared, torch.randint(0, VOCAB, (length,), generator=gen)])
            samples.append({"tokens": tokens, "prompt": prompt, "advantage": float(torch.randn(1, generator=gen))})
    return samples


def pack(samples: Sequence[dict]) -> dict:
    """One micro-batch packed as frameworks pack it: ids [1, T], next-token labels, cu_seqlens, and
    per row the advantage of the response token it predicts (0 elsewhere)."""
    tokens = torch.cat([s["tokens"] for s in samples])
    labels = torch.cat([tokens[1:], tokens[:1]])
    weights = torch.zeros(tokens.numel())
    cu = [0]
    for s in samples:
        start, length = cu[-1], s["tokens"].numel()
        weights[start + s["prompt"] - 1:start + length - 1] = s["advantage"]  # rows predicting the response
        cu.append(start + length)
    return {"tokens": tokens[None], "labels": labels, "weights": weights, "cu_seqlens": torch.tensor(cu)}


def forward_step(shared: bool):
    """A forward step for megatron-core's schedule: the policy-gradient loss of the micro-batch."""

    def step(iterator: Any, model: Any) -> tuple[Any, Any]:
        batch = next(iterator)
        if shared:  # the one line: where each sample's prompt is shared, as the micro-batch's packed_seq_params
            params = shared_prefix_params(plan_shared_prefix(batch["tokens"], batch["cu_seqlens"]))
        else:  # each sample packed whole (megatron-core's thd packing)
            from megatron.core.packed_seq_params import PackedSeqParams

            cu, longest = batch["cu_seqlens"].int(), int(batch["cu_seqlens"].diff().max())
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                                     max_seqlen_kv=longest)
        positions = None if shared else torch.cat([torch.arange(int(n)) for n in batch["cu_seqlens"].diff()])[None]
        logits = model(batch["tokens"], positions, None, packed_seq_params=params)

        def loss(output: Any) -> tuple[Any, dict]:
            log_probs, _ = log_probs_and_entropy(output[0], batch["labels"])
            value = -(batch["weights"] * log_probs).sum() / batch["weights"].ne(0).sum()
            return value, {"loss": value.detach()}

        return logits, loss

    return step


def train_step(model: Any, micro_batches: list[dict], shared: bool) -> tuple[float, dict[str, Any]]:
    """One step through megatron-core's real forward-backward schedule: (the loss, the gradients)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    reported = get_forward_backward_func()(
        forward_step_func=forward_step(shared), data_iterator=iter(micro_batches), model=[model],
        num_microbatches=len(micro_batches), seq_length=max(b["tokens"].size(1) for b in micro_batches),
        micro_batch_size=1, forward_only=False)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(sum(r["loss"] for r in reported)), grads


def fewer(computed: int, packed: int) -> str:
    """How many fewer tokens the model computed than packed whole, in words."""
    if computed >= packed:
        return "the same: no micro-batch holds two samples of one prompt"
    ratio = packed / computed
    return f"{ratio:.1f}x fewer" if ratio >= 1.05 else f"{packed - computed} fewer, {ratio:.2f}x"


def main(argv: Sequence[str] | None = None) -> dict:
    hide_import_notes()  # megatron-core's notes that Transformer Engine / Apex are missing on CPU
    logging.getLogger("megatron.core.models.gpt.gpt_model").setLevel(logging.ERROR)  # 0.19's GPTModel notice
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=96)
    parser.add_argument("--response", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=200, help="physical tokens per micro-batch")
    args = parser.parse_args(argv)
    samples = grpo_samples(args.groups, args.group_size, args.prompt, args.response)
    # micro-batches counted in the tokens the model computes: a group's prompt once
    chosen = shared_prefix_micro_batches([s["tokens"] for s in samples], args.max_tokens)
    micro_batches = [pack([samples[i] for i in indices]) for indices in chosen]
    with megatron_on_cpu():
        model = build_packed_gpt(vocab_size=VOCAB, seq_length=args.prompt + args.response,
                                 config=tiny_gpt_config(num_query_groups=2), seed=1)
        check_shared_prefix(model, training=True)  # before the pass: the same answer on every rank
        prepare_shared_prefix(model)  # once: the model's attention learns to read a shared prefix
        loss, grads = train_step(model, micro_batches, shared=True)
        whole_loss, whole_grads = train_step(model, micro_batches, shared=False)
    packed = sum(b["tokens"].numel() for b in micro_batches)
    computed = sum(plan_shared_prefix(b["tokens"], b["cu_seqlens"]).stats.physical_tokens for b in micro_batches)
    worst = max(float((grads[n] - whole_grads[n]).abs().max()) / max(1.0, float(whole_grads[n].abs().max()))
                for n in whole_grads)
    print(f"micro-batches: {len(micro_batches)} of at most {args.max_tokens} computed tokens "
          f"({len(samples)} samples)")
    print(f"tokens: computed {computed} for {packed} packed whole ({fewer(computed, packed)})")
    print(f"loss {loss:.5f}, each sample packed whole {whole_loss:.5f}; gradients equal within 2e-6: {worst < 2e-6}")
    return {"loss": loss, "whole_loss": whole_loss, "worst": worst, "computed": computed, "packed": packed}


if __name__ == "__main__":
    main()
