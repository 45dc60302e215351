"""The live self-teacher in NeMo-RL (`self_teacher_policy(context=KEY)`): the student's own
`get_topk_logits` (NeMo-RL 7ea279ab's driver and TopkLogitsPostProcessor on `nemo_rl_topk`, as
its Megatron worker runs them) over context + response, the rows placed at the student's
positions, then NeMo-RL's distillation step on them (`nemo_rl_topk_kd`, forward KL). At TP=1 and
TP=2 in one 2-rank world: the teacher's rows equal the float64 forward of the same weights on the
privileged sequence; the loss and each rank's gradients equal the float64 reference with the
teacher's terms detached; controls (no context, the context shifted by one token) miss by far.
In the same world NeMo-RL's own teacher Policy (other random weights) through
`PrivilegedTeacherPolicy`: its rows equal its float64 forward on context + response, its controls
miss by far."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("nemo_rl", reason="NeMo-RL's source is not on the path: run `make test-nemo NEMO_RL=...`")
pytestmark = [pytest.mark.nemo_rl, pytest.mark.multirank, pytest.mark.megatron]

import nemo_kit as kit  # noqa: E402
import self_teacher_ranks as world  # noqa: E402

from megatron_rl_patches.testing.multirank import run_multirank  # noqa: E402

BOUND = 1e-5


def float64_log_probs(model64, sequence: torch.Tensor) -> torch.Tensor:
    """[n, V] float64 log-probs of the model on one sequence (row s predicts token s + 1)."""
    n = sequence.numel()
    causal = torch.ones(n, n, dtype=torch.bool).tril().logical_not()[None, None]
    return torch.log_softmax(model64(sequence[None], torch.arange(n)[None], causal)[0].double(), -1)


def shard_of(full: torch.Tensor, local: torch.Tensor, rank: int) -> torch.Tensor:
    if full.shape == local.shape:
        return full
    (dim,) = [d for d in range(full.dim()) if full.shape[d] != local.shape[d]]
    return full.chunk(2, dim=dim)[rank]


def tails(log_probs: torch.Tensor) -> torch.Tensor:
    return torch.log1p(-log_probs.exp().sum(-1).clamp(max=1 - 1e-12))


def check_own_teacher(teacher64, got: list[dict], tp: int) -> None:
    """NeMo-RL's own teacher Policy's privileged rows against its float64 forward on context +
    response at the student's positions (both ranks); without the context / shifted: far off."""
    data, hints = kit.batch(seed=3), world.contexts()
    ids, lengths, mask = data["input_ids"], data["input_lengths"], data["token_mask"]
    misses, error = {"none": 0.0, "shifted": 0.0}, 0.0
    with torch.no_grad():
        for i in range(kit.BATCH):
            n = int(lengths[i])
            start = int(torch.nonzero(mask[i, 1:n]).flatten()[0]) + 1
            response, rows = ids[i, start:n], slice(start - 1, n - 1)
            teacher = float64_log_probs(teacher64, torch.cat([hints[i], response]))[len(hints[i]) - 1:-1]
            for out in got:
                assert out["teacher_calls"] == 1, tp
                assert torch.equal(out["teacher_ids"][i, rows], teacher.topk(kit.K, -1).indices), (tp, i)
                error = max(error, float((out["teacher_values"][i, rows].double()
                                          - teacher.gather(1, out["teacher_ids"][i, rows])).abs().max()))
            values, top = got[0]["teacher_values"], got[0]["teacher_ids"]
            for name, context in (("none", ids[i, :start]), ("shifted", hints[i].roll(1))):
                control = float64_log_probs(teacher64, torch.cat([context, response]))[len(context) - 1:-1]
                misses[name] = max(misses[name], float((control.gather(1, top[i, rows]) - values[i, rows])
                                                       .abs().max()))
    assert not torch.equal(got[0]["teacher_ids"], got[0]["ids"]), tp  # its own weights, not the student's
    print(f"tp {tp}: NeMo-RL's own teacher's privileged rows: error {error:.2e}, controls {misses}")
    assert error <= BOUND and min(misses.values()) > kit.CONTROL, (tp, error, misses)


def test_the_live_self_teacher_in_nemo_rls_step_equals_float64_at_tp1_and_tp2():
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu, tiny_gpt_config
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    ranks = run_multirank(world.self_teacher_world, 2, [1, 2], timeout=900)
    data, hints = kit.batch(seed=3), world.contexts()
    ids, lengths, mask = data["input_ids"], data["input_lengths"], data["token_mask"]
    with megatron_on_cpu():
        model64 = build_packed_gpt(vocab_size=kit.VOCAB, seq_length=64, seed=0,
                                   config=tiny_gpt_config(num_layers=2)).double()
        teacher64 = build_packed_gpt(vocab_size=kit.VOCAB, seq_length=64, seed=world.TEACHER_SEED,
                                     config=tiny_gpt_config(num_layers=2)).double()
        for tp_index, tp in enumerate((1, 2)):
            got = [rank[tp_index] for rank in ranks]
            check_own_teacher(teacher64, got, tp)
            values, top = got[0]["values"], got[0]["ids"]
            model64.zero_grad()
            total, misses = torch.zeros((), dtype=torch.float64), {"none": 0.0, "shifted": 0.0}
            for i in range(kit.BATCH):
                n = int(lengths[i])
                start = int(torch.nonzero(mask[i, 1:n]).flatten()[0]) + 1
                response = ids[i, start:n]
                rows = slice(start - 1, n - 1)
                teacher = float64_log_probs(model64, torch.cat([hints[i], response]))[len(hints[i]) - 1:-1].detach()
                for out in got:  # both ranks alike: the teacher's rows at the student's positions
                    assert torch.equal(out["ids"][i, rows], teacher.topk(kit.K, -1).indices), (tp, i)
                    torch.testing.assert_close(out["values"][i, rows].double(), teacher.gather(1, out["ids"][i, rows]),
                                               rtol=0, atol=BOUND)
                for name, context in (("none", ids[i, :start]), ("shifted", hints[i].roll(1))):
                    control = float64_log_probs(model64, torch.cat([context, response]))[len(context) - 1:-1]
                    misses[name] = max(misses[name], float((control.gather(1, top[i, rows]) - values[i, rows])
                                                           .abs().max()))
                # the student's (k+1)-bucket forward KL against the detached teacher, NeMo-RL's token mean
                q = teacher.gather(1, top[i, rows])
                p = float64_log_probs(model64, ids[i, :n])[rows].gather(1, top[i, rows])
                q_all, p_all = torch.cat([q, tails(q)[:, None]], 1), torch.cat([p, tails(p)[:, None]], 1)
                kl = (q_all.exp() * (q_all - p_all)).sum(-1)
                total = total + (kl * mask[i, start:n].double()).sum()
            total = total / (mask[:, 1:] * data["sample_mask"][:, None]).sum()
            total.backward()
            reference = {name: p.grad for name, p in model64.named_parameters() if p.grad is not None}
            assert min(misses.values()) > kit.CONTROL and reference and float(total) > 0, misses
            scale = max(float(g.abs().max()) for g in reference.values())
            grad_error = max(float((g.double() - shard_of(reference[n], g, r)).abs().max())
                             for r, o in enumerate(got) for n, g in o["grads"].items())
            loss_error = max(abs(o["loss"] - float(total)) for o in got)
            print(f"tp {tp}: loss {float(total):.6g}, controls {misses}, errors: loss {loss_error:.2e}, gradient "
                  f"{grad_error:.2e} (largest gradient {scale:.2e})")
            for rank, out in enumerate(got):
                assert out["untouched"] and out["calls"] == 1, (tp, rank)
                assert abs(out["loss"] - float(total)) <= BOUND, (tp, rank, out["loss"], float(total))
                assert out["grads"].keys() == reference.keys()
                for name, grad in out["grads"].items():
                    torch.testing.assert_close(grad.double(), shard_of(reference[name], grad, rank), rtol=0,
                                               atol=1e-4 * scale, msg=f"tp {tp} rank {rank} {name}")
                assert "data['hint'] holds 3 contexts for a batch of 4 samples" in out["missing"], out["missing"]
