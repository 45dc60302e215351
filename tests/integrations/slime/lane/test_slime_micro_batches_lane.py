"""slime 624b824a's real rollout manager schedules `--use-dynamic-batch-size --max-tokens-per-gpu N`
micro-batches in the tokens the model computes with shared-prefix packing on (`slime_fused`, issue
111 item 7): 8 groups of 8 samples at P = 1,024, R = 128 and N = 9,216 take 8 micro-batches counted
whole and 2 counted as computed (each group whole, every micro-batch's plan within N), at data-parallel
sizes 1 and 2; with the setting off, or unpatched, slime's own schedule to the index. One fresh
interpreter per case (slime_micro_batches.py), as slime_rollout_split.py runs. Then slime's real
train_actor on the fewer micro-batches equals its step on the micro-batches counted whole."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slime
HERE = os.path.dirname(__file__)


def schedule(patched: bool, shared: str) -> dict:
    env = {**os.environ, "MEGATRON_RL_PATCHES_SHARED_PREFIX": shared}
    env.pop("MEGATRON_RL_PATCHES", None)
    done = subprocess.run([sys.executable, os.path.join(HERE, "slime_micro_batches.py"),
                           "patched" if patched else "unpatched"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_slimes_own_schedule_counts_the_tokens_the_model_computes_with_sharing_on(slime_cpu):
    unpatched = schedule(False, "1")
    assert unpatched["wrapped"] == [False]
    (whole,) = unpatched["dp1"]
    assert len(whole["micro_batches"]) == 8 and max(whole["logical"]) <= 9216  # 8 samples of 1,152 each
    off = schedule(True, "0")
    assert off["wrapped"] == [True] and (off["dp1"], off["dp2"]) == (unpatched["dp1"], unpatched["dp2"])

    shared = schedule(True, "1")
    assert shared["wrapped"] == [True]
    (one,) = shared["dp1"]
    assert len(one["micro_batches"]) == 2 and one["num_microbatches"] == [2]
    assert sorted(i for batch in one["micro_batches"] for i in batch) == list(range(64))
    assert all(physical <= 9216 < logical for physical, logical in zip(one["physical"], one["logical"]))
    for batch in one["micro_batches"]:  # each group whole in one micro-batch: 4 groups of 8, 8,192 tokens computed
        assert sorted(batch) == sorted(g * 8 + m for g in {i // 8 for i in batch} for m in range(8))
    assert one["physical"] == [4 * (1024 + 8 * 128)] * 2
    two = shared["dp2"]  # two ranks: one micro-batch each, the step's samples once
    assert [rank["num_microbatches"] for rank in two] == [[1], [1]]
    assert sorted(i for rank in two for i in rank["partition"]) == list(range(64))
    assert all(p <= 9216 for rank in two for p in rank["physical"])


SMALL = {"groups": 4, "group": 4, "prompt": 24, "response": 6}  # the lane model's 64 positions hold a sample


def small_rollout(vocab: int, micro_batches: list[list[int]]) -> dict:
    """4 GRPO groups of 4 samples (slime's per-sample fields; one masked response token each)."""
    import torch

    gen = torch.Generator().manual_seed(7)
    tokens, masks, advantages = [], [], []
    for _ in range(SMALL["groups"]):
        prompt = torch.randint(0, vocab, (SMALL["prompt"],), generator=gen)
        for _ in range(SMALL["group"]):
            tokens.append(torch.cat([prompt, torch.randint(0, vocab, (SMALL["response"],), generator=gen)]))
            mask = torch.ones(SMALL["response"], dtype=torch.int)
            mask[SMALL["response"] // 2] = 0
            masks.append(mask)
            advantages.append(torch.randn(SMALL["response"], generator=gen))
    return {"tokens": tokens, "total_lengths": [len(t) for t in tokens],
            "response_lengths": [SMALL["response"]] * len(tokens), "loss_masks": masks, "advantages": advantages,
            "micro_batch_indices": micro_batches}


# each group cut by the budget, one over three micro-batches (samples 0-3, 4-7, 8-11, 12-15 share a prompt)
CUT = [[0, 1], [2, 3, 4], [5, 6], [7, 8, 9], [10, 11], [12, 13, 14, 15]]


def per_micro_batch_and_step(tokens: list, micro_batches: list[list[int]]) -> tuple[int, int, int]:
    """Tokens a pass computes over `micro_batches`: each planned on its own, the step planned together
    (its held segments' side passes included), and the rows it holds."""
    from megatron_rl_patches.shared_prefix import plan_shared_prefix, plan_shared_prefix_step

    def packed(batch: list[int]) -> tuple:
        import torch

        ids = torch.cat([tokens[i] for i in batch])
        return ids, torch.tensor([0, *torch.tensor([len(tokens[i]) for i in batch]).cumsum(0).tolist()])

    each = sum(plan_shared_prefix(*packed(batch)).stats.physical_tokens for batch in micro_batches)
    step = plan_shared_prefix_step([packed(batch) for batch in micro_batches]).stats
    return each, step.computed_tokens, step.held_tokens


def test_a_step_on_the_fewer_micro_batches_equals_slimes_step_counted_whole(slime_cpu):
    """slime's real train_actor (reference pass, log-prob pass, two snapshot teachers, train()) over two
    rollouts on the micro-batches each schedule gives, setting off (slime's first fit by whole lengths:
    4 each) and on: the first rollout cut below one group (`CUT`: every pass plans its step together,
    each prompt computed once however many micro-batches hold its group, issue 120), the second on the
    package's fewer micro-batches (as the patched first fit packs them: 2). slime scales each
    micro-batch's loss by the step's sample count, so both steps' losses, the weights after them and
    the first rollout's recorded log-probs agree within 1e-6 (the reference's peaked log-probs 2e-6)."""
    import slime_kit as kit
    import slime_ranks
    import torch
    from slime.utils.seqlen_balancing import first_fit_pack

    from megatron_rl_patches.shared_prefix import shared_prefix_micro_batches
    from megatron_rl_patches.testing.multirank import run_multirank

    tokens = small_rollout(kit.VOCAB, [])["tokens"]
    budget = 4 * (SMALL["prompt"] + SMALL["response"])  # four samples counted whole, or two groups computed
    whole = first_fit_pack([len(t) for t in tokens], budget)
    computed = shared_prefix_micro_batches(tokens, budget)
    assert (len(whole), len(computed)) == (4, 2)
    results = {}
    for on, micro_batches in ((False, [whole, whole]), (True, [CUT, computed])):
        extra = {"shared_prefix": on, "ref": True, "rollouts": [small_rollout(kit.VOCAB, m) for m in micro_batches]}
        (results[on],) = run_multirank(slime_ranks.opd_train_actor, 1, 1, 1, 1, None, None, ("--adam-eps", "1.0"), 2,
                                       None, 1, None, None, None, {"TEACHERS": "teacher-a,teacher-b"}, None, extra,
                                       timeout=400)
    off, on = results[False], results[True]
    # the reference snapshot's peaked log-probs (near -15) move by a few float32 steps with the rows a
    # matrix product holds: 2e-6 of their scale, as the shared-prefix lane allows its teachers' log-probs
    for field, tol in (("old_log_probs", 1e-6), ("ref_log_probs", 2e-6), ("updated", 1e-6)):
        want, got = off[field], on[field]
        pairs = list(zip(got.values(), want.values())) if isinstance(want, dict) else list(zip(got, want))
        assert len(pairs) == len(want) and pairs and all(torch.is_tensor(b) for _, b in pairs), field
        for a, b in pairs:
            scale = max(1.0, float(b.abs().max()))
            assert float((a - b).abs().max()) <= tol * scale, (field, float((a - b).abs().max()), scale)
    assert len(off["losses"]) == len(on["losses"]) == 2  # slime's logged steps: loss, pg, entropy, top-k OPD
    for plain, planned in zip(off["losses"], on["losses"]):
        assert planned.keys() == plain.keys()
        assert all(abs(planned[k] - v) <= 1e-6 * max(1.0, abs(v)) for k, v in plain.items()), (plain, planned)
    assert on["prefix_passes"] and all(f["physical_tokens"] < f["logical_tokens"] for _, f in on["prefix_passes"])
    # every pass (the reference's and the log-prob pass, the ids' and two teachers' passes, the step) plans its step
    # together: the first rollout's three cut groups held, the second's groups whole (their prompts' first ids
    # alike: one held row); each prompt computed once, fewer tokens than planning each micro-batch on its own
    each, step, held = per_micro_batch_and_step(tokens, CUT)
    passes = [figures for _, figures in on["prefix_passes"]]
    assert len(passes) == 12 and {what for what, _ in on["prefix_passes"]} == {
        "slime's log-prob pass", "a teacher's pass", "slime's training step"}
    assert [f["held_tokens"] for f in passes[:6]] == [held] * 6 and held >= 3 * (SMALL["prompt"] - 1)
    assert all(f["physical_tokens"] == step for f in passes) and step < each, (step, each)
    assert sum(on["embedded"]) < sum(off["embedded"]), (sum(on["embedded"]), sum(off["embedded"]))
    print(f"per pass: {each} tokens planned per micro-batch, {step} per step ({held} held); ids embedded "
          f"{sum(on['embedded'])} on, {sum(off['embedded'])} off")
