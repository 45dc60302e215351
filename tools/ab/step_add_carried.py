"""For `../shared/tools/ab-bench REV_A REV_B -- python tools/ab/step_add_carried.py`: `TeacherStep.add`
handed a served teacher's rows carried from the rollout (slime's `MEGATRON_RL_PATCHES_OPD_SCORE_AT=rollout`
route: `carried_rows.add_carried`, every sample's rows read back and checked as a served reply, nothing
asked; and `add(scored={0: ScoredBefore(...)})` alone), timed in one process: the best of `--rounds`
calls after 3 warm-up calls, `--samples` samples of `--prompt` + `--response` ids, K = `--k`, V = 1001,
1 thread. The rows are a real distribution's (a random log-softmax's top-k, the exact tail, the
token's own log-prob): every check passes. One JSON line (milliseconds)."""
from __future__ import annotations

import argparse
import json
import time

import torch

from megatron_rl_patches.integrations.megatron.opd.carried_rows import (
    CARRIED,
    add_carried,
    packed,
    teacher_key,
)
from megatron_rl_patches.teachers import BatchScores, ServedTeacher, TeacherBatch, TeacherStep, local_host
from megatron_rl_patches.teachers.step.parts import ScoredBefore, ids_digest
from megatron_rl_patches.teachers.tails import tail_log_probs

VOCAB = 1001


def scored(batch: TeacherBatch, k: int, gen: torch.Generator) -> list[BatchScores]:
    """Each sample's rows as a served teacher answers them (float64, int64)."""
    answers = []
    for ids, start in zip(batch.sequences, batch.response_starts):
        log_probs = torch.log_softmax(torch.randn(len(ids) - start, VOCAB, generator=gen, dtype=torch.float64) * 3, -1)
        values, top = log_probs.topk(k, dim=-1)
        token = log_probs.gather(1, ids[start:, None])[:, 0]
        answers.append(BatchScores([token], [top], [values], [tail_log_probs(values)]))
    return answers


def best_ms(run, rounds: int) -> float:
    for _ in range(3):
        run()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--response", type=int, default=256)
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    batch = TeacherBatch([torch.randint(0, VOCAB, (args.prompt + args.response,), generator=gen)
                          for _ in range(args.samples)], [args.prompt] * args.samples)
    answers = scored(batch, args.k, gen)
    with ServedTeacher("http://127.0.0.1:9", top_k=args.k) as teacher:  # never asked: every row is given
        key = teacher_key(teacher, None)
        one = [TeacherBatch([ids], [start]) for ids, start in zip(batch.sequences, batch.response_starts)]
        carried = [{key: packed(answer, part)} for answer, part in zip(answers, one)]
        before = ScoredBefore([(ids_digest(ids, start), answer) for ids, start, answer in
                               zip(batch.sequences, batch.response_starts, answers)], vocab_size=VOCAB)

        def carried_add() -> None:
            step = TeacherStep([teacher], local_host(VOCAB))
            assert add_carried(step, batch, None, {CARRIED: carried})
            step.collect()

        def given_add() -> None:
            step = TeacherStep([teacher], local_host(VOCAB))
            step.add(batch, scored={0: before})
            step.collect()

        result = {"carried_add_ms": best_ms(carried_add, args.rounds), "scored_before_add_ms": best_ms(
            given_add, args.rounds)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
