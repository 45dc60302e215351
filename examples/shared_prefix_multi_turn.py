"""Multi-turn samples packed by shared prefix in a hand-written megatron-core loop (docs/shared-prefix.md):
an agent's trace that branches (its final trajectories as samples) and one trajectory kept as a
sample per turn (each sample the one before with a turn more), each packed into one micro-batch and
run two ways: sharing each group's longest common prefix only (`levels=1`) and sharing every run of
turns at every level it branches (the default). Each against the same samples packed whole: the
tokens the model computes, a training step's loss and every gradient.

    .venv/bin/python examples/shared_prefix_multi_turn.py [--system 24] [--user 4] [--assistant 6]

(`.venv/bin/python`: the clone's environment, which `make venv` or `make demo` builds; run from the
clone's root.) megatron-core runs on CPU through the test kit's shims (megatron_rl_patches.testing);
on a GPU machine, initialize Megatron as usual instead of entering `megatron_on_cpu()`.
"""
from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from megatron_rl_patches import log_probs_and_entropy
from megatron_rl_patches.apps.quiet import hide_import_notes
from megatron_rl_patches.shared_prefix import (
    check_shared_prefix,
    plan_shared_prefix,
    prepare_shared_prefix,
    shared_prefix_params,
)
from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu, tiny_gpt_config
from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

VOCAB = 64
BRANCHES = (1, 2, 2)  # answers per trajectory at turns 1, 2, 3: 4 final trajectories
WAYS = {"one level": 1, "every level": None}  # plan_shared_prefix's `levels` per way


class Sample(NamedTuple):
    """One sample: its ids and, per id, whether the assistant wrote it (the rows the loss reads)."""

    ids: list[int]
    answer: list[bool]


def trace(system: int, user: int, assistant: int, seed: int = 0) -> tuple[list[Sample], list[Sample]]:
    """(the branching trace's final trajectories, its first trajectory as one sample per turn)."""
    gen = torch.Generator().manual_seed(seed)

    def draw(n: int) -> list[int]:
        return torch.randint(0, VOCAB, (n,), generator=gen).tolist()

    trajectories = [Sample(draw(system), [False] * system)]
    per_turn = []
    for answers in BRANCHES:
        grown = []
        for so_far in trajectories:
            asked = Sample(so_far.ids + draw(user), so_far.answer + [False] * user)
            grown += [Sample(asked.ids + draw(assistant), asked.answer + [True] * assistant) for _ in range(answers)]
        trajectories = grown
        per_turn.append(trajectories[0])
    return trajectories, per_turn


def pack(samples: Sequence[Sample]) -> dict[str, torch.Tensor]:
    """The samples packed one after another as frameworks pack them: ids [1, T], next-token labels,
    cu_seqlens, positions (each sample's own), and the rows that predict an assistant's token."""
    ids = torch.tensor([i for s in samples for i in s.ids])
    predicts = torch.tensor([a for s in samples for a in s.answer[1:] + [False]])
    lengths = torch.tensor([len(s.ids) for s in samples])
    return {"tokens": ids[None], "labels": torch.cat([ids[1:], ids[:1]]), "rows": predicts,
            "cu_seqlens": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
            "positions": torch.cat([torch.arange(int(n)) for n in lengths])[None]}


def whole_params(cu_seqlens: torch.Tensor) -> Any:
    """megatron-core's own packing (`thd`): each sample whole, attending to itself."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu, longest = cu_seqlens.int(), int(cu_seqlens.diff().max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


def step(model: Any, batch: dict[str, torch.Tensor], params: Any, positions: Any) -> tuple[float, dict]:
    """One forward and backward of the mean negative log-prob of the assistants' tokens: (the
    loss, every parameter's gradient)."""
    logits = model(batch["tokens"], positions, None, packed_seq_params=params)
    log_probs, _ = log_probs_and_entropy(logits[0], batch["labels"])
    loss = -log_probs[batch["rows"]].mean()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def worst_gradient(grads: dict, whole: dict) -> float:
    """The largest gradient difference, relative to each parameter's largest gradient (at least 1)."""
    return max(float((grads[n] - whole[n]).abs().max()) / max(1.0, float(whole[n].abs().max())) for n in whole)


def compare(model: Any, name: str, samples: Sequence[Sample]) -> dict[str, Any]:
    """The micro-batch of `samples` packed whole and planned each way: the tokens, the losses, the
    gradients' largest difference, the default plan (printed, and its tree)."""
    batch = pack(samples)
    whole_loss, whole_grads = step(model, batch, whole_params(batch["cu_seqlens"]), batch["positions"])
    found: dict[str, Any] = {"name": name, "samples": len(samples), "packed": batch["tokens"].numel(),
                             "whole_loss": whole_loss}
    for way, levels in WAYS.items():
        plan = plan_shared_prefix(batch["tokens"], batch["cu_seqlens"], levels=levels)
        loss, grads = step(model, batch, shared_prefix_params(plan), None)
        found[way] = {"computed": plan.stats.physical_tokens, "loss": loss,
                      "worst": worst_gradient(grads, whole_grads), "plan": plan}
    return found


def fewer(computed: int, packed: int) -> str:
    return f"{packed / computed:.1f}x fewer"


def report(found: dict[str, Any], described: str) -> None:
    print(f"{found['name']}: {found['samples']} samples ({described})")
    print(f"  packed whole    {found['packed']:4d} tokens, loss {found['whole_loss']:.5f}")
    for way in WAYS:
        one = found[way]
        exact = abs(one["loss"] - found["whole_loss"]) < 1e-6 and one["worst"] < 2e-6
        print(f"  {way:<15s} {one['computed']:4d} tokens computed ({fewer(one['computed'], found['packed'])}), "
              f"loss {one['loss']:.5f}; loss within 1e-6 and gradients within 2e-6: {exact}")


def main(argv: Sequence[str] | None = None) -> dict:
    hide_import_notes()  # megatron-core's notes that Transformer Engine / Apex are missing on CPU
    logging.getLogger("megatron.core.models.gpt.gpt_model").setLevel(logging.ERROR)  # 0.19's GPTModel notice
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--system", type=int, default=24, help="tokens of the system prompt")
    parser.add_argument("--user", type=int, default=4, help="tokens of each user message")
    parser.add_argument("--assistant", type=int, default=6, help="tokens of each assistant reply")
    args = parser.parse_args(argv)
    branching, per_turn = trace(args.system, args.user, args.assistant)
    turns = f"{len(BRANCHES)} turns of {args.user} + {args.assistant} tokens"
    with megatron_on_cpu():
        model = build_packed_gpt(vocab_size=VOCAB, seq_length=len(branching[0].ids),
                                 config=tiny_gpt_config(num_query_groups=2), seed=1)
        check_shared_prefix(model, training=True)  # before the pass: the same answer on every rank
        prepare_shared_prefix(model)  # once: the model learns to read a sharing plan
        found = [compare(model, "a branching trace", branching), compare(model, "a sample per turn", per_turn)]
    report(found[0], f"a system prompt of {args.system} tokens, {turns}, branching 2 ways at turns 2 and 3")
    report(found[1], f"one trajectory after each of its {turns}")
    plan = found[0]["every level"]["plan"]
    print(f"the branching trace's sharing plan: {plan}")
    for node in plan.tree():
        print(node)
    return {"found": found}


if __name__ == "__main__":
    main()
