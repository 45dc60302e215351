"""A teacher served by vLLM in a hand-written Megatron training loop, on CPU, at 1 or 2 ranks
(tensor parallelism 2): a tiny GPTModel student learns from the served teacher's own top-k with
their exact tail (docs/distillation.md, "Teachers served by an inference engine"); with --head
from the teacher's whole vocabulary instead (a pooling server's hidden states through the
teacher's output layer); with --in-process an in-process teacher (a frozen tiny GPTModel at the
student's layout) joins the top-k teacher on the same teacher step, or stands alone without a server.

Run it with the package's interpreter (torch, megatron-core: `.venv/bin/python` after `make
venv`); --vllm-python names vLLM's own (its CPU build in another venv: `make test-served` builds
.lanes/vllm and runs this example's tests against it):

    .venv/bin/python examples/served_teacher_loop.py --vllm-python .lanes/vllm/bin/python [--tp 2] [--steps 4]
    # the whole vocabulary: the teacher served by a pooling server, its head on the trainer
    .venv/bin/python examples/served_teacher_loop.py --vllm-python .lanes/vllm/bin/python --head [--tp 2]
    # or a server you already run, of a model with the student's tokenizer and vocabulary (a pooling
    # server and its Hugging Face directory with --head DIR):
    .venv/bin/python examples/served_teacher_loop.py --url http://teacher-node:8000 --vocab-size 1001 [--tp 2]
    # beside the top-k teacher (or, without --url / --vllm-python, alone) an in-process teacher:
    .venv/bin/python examples/served_teacher_loop.py --vllm-python .lanes/vllm/bin/python --in-process [--tp 2]
    # (a server started with an API key: the key in $MEGATRON_RL_PATCHES_TEACHER_API_KEY)
    # a teacher's replicas: their URLs joined by '|'; --pause gives time to stop one by hand mid-run
    .venv/bin/python examples/served_teacher_loop.py --url 'http://127.0.0.1:8001|http://127.0.0.1:8002' --pause 5
    # the tiny teacher alone (a directory vLLM's CPU build serves), for servers of your own
    .venv/bin/python examples/served_teacher_loop.py --save-teacher /tmp/tiny-teacher

With --vllm-python the example writes a tiny random Qwen3 teacher (1001 words, its tokenizer
beside it: it needs transformers and tokenizers) and serves it on 127.0.0.1 for the run (up to 2
minutes to start on CPU, said when it starts; with --head as a pooling server). Each step's line is
printed when the step ends. Each step:

1. The served teacher is built from its entry (`build_teachers("URL;engine=vllm;same_tokenizer;
   vocab=N", host, top_k=K)`: the entry grammar of MEGATRON_RL_PATCHES_OPD_TEACHERS, connected by
   the asking rank: the server answers, K within its limit). The samples (prompt + response ids;
   stand-ins for your rollouts) go to the server through the teacher step (`TeacherStep` behind
   `megatron_host`: the loop's groups) as the rollout finishes them: `step.add(TeacherBatch([ids],
   [start]))` per sample, each asked at once, and `collect()` returns them all in the order added.
   The first rank of the tensor-parallel group asks, a failure there is raised on every rank, and
   the scores are broadcast to the group (every rank holds the same samples under tensor
   parallelism).
2. The served rows are placed where the student's forward scores them. Row r of sample i scores
   the token at `start_i + r`; Megatron's position p predicts the token at p + 1, so that row is
   the student's position `start_i + r - 1` (the one-position shift). The served `topk_ids`
   [R_i, K] go into `topk_output_processor`'s context ids [b, s, K] there; "row_mask" selects
   those positions (the prompt and the padding are never computed).
3. The student's forward runs the fused LM head (`lm_head_topk_logprobs` under the processor: no
   [T, V] logits): its log-probs at the served ids and its exact tail. Under tensor parallelism the
   ids stay global vocabulary ids; each rank holds half of the output layer and the op combines
   the halves. The student's vocabulary is padded as Megatron pads it (1001 -> 1024);
   `vocab_size=` gives the real one, so the padding rows take no mass.
4. The loss is `topk_kl` over the k + 1 buckets with the served tail (forward KL, teacher to
   student), then backward and an Adam step.

With --head (the whole-vocabulary route), steps 1-4 become:

1. The entry names the teacher's Hugging Face directory (`"URL;engine=vllm;head=DIR;same_tokenizer;
   vocab=N"`): `build_teachers` reads its output layer for the host's student, this rank's shard of
   the vocabulary padded as Megatron pads the student's (1001 -> 1024, halves at TP=2), and the
   pooling server sends the teacher's final hidden states [R_i, H_t] per sample (`scores.hidden_states`).
2. Row r of sample i is the state that predicts the token at start_i + r: it goes to the student's
   position start_i + r - 1 of a [b, s, H_t] tensor (the same one-position shift).
3. The student's forward runs `divergence_output_processor` with that tensor as "teacher_hidden"
   and the head's shard (`teacher.head.weight`) as "teacher_weight": the exact divergence over the
   whole vocabulary from both models' hidden states, tile by tile (no [T, V] logits), with the
   gradient to the student (the states of `hidden_output_processor` are a detached copy: the
   teacher's side only).
4. The loss is the mean forward KL over the response rows.

With --in-process, `InProcessTeacher` (any object with `.top_k` and `.score(TeacherBatch) ->
BatchScores` serves) is the step's second teacher: `collect()` runs it on every rank (it is
tensor-parallel like the student) after the served requests went out, so the server works while
it does. Each teacher's own top-k are scored by the student (one forward per teacher: the ids
differ) and the loss is the mean of the teachers' divergences.

On a GPU cluster: initialize Megatron as usual instead of entering `megatron_on_cpu()`, use your
model and optimizer; the placing of the served rows and the loss stay as they are.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

K = 8  # the teacher's buckets per row (vLLM's --max-logprobs, default 20, bounds it)
PROMPTS = (4, 7, 3, 5)  # each sample's prompt length: its response starts there
LENGTHS = (12, 20, 9, 16)  # each sample's whole length (prompt + response)
STEPS = 4
LR = 1e-2
PAD_TO = 128  # Megatron pads the vocabulary to a multiple of 128 x TP (make-vocab-size-divisible-by)
# vLLM's pooling runner serving a causal LM's final hidden states per token (the --head route)
POOLING = ("--runner", "pooling", "--convert", "embed", "--pooler-config", '{"task": "token_embed"}')

warnings.filterwarnings("ignore", module="megatron")  # Apex / Transformer Engine absent on CPU (every rank)


@dataclass
class StepInputs:
    """What one step computed its loss from, for `on_loss` (the served lane checks it)."""

    step: int
    student: torch.nn.Module
    tokens: torch.Tensor  # [b, s]: the student's input (each sample without its last id, padded)
    samples: Any  # the TeacherBatch sent to the server
    scores: Any  # the first teacher's BatchScores (the same on every rank)
    loss: torch.Tensor  # the step's loss, before backward
    vocab_size: int
    every: list = field(default_factory=list)  # every teacher's BatchScores, in the step's order
    teacher_weight: Any = None  # --head: this rank's shard of the teacher's output layer


def padded(vocab_size: int, tp: int) -> int:
    """The student's vocabulary rows as Megatron pads them."""
    multiple = PAD_TO * tp
    return -(-vocab_size // multiple) * multiple


def rollouts(step: int, seed: int, vocab_size: int) -> list[torch.Tensor]:
    """Stand-ins for the step's rollouts: one id sequence per sample (the same on every rank)."""
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    return [torch.randint(0, vocab_size, (n,), generator=gen) for n in LENGTHS]


def placed(sequences: list[torch.Tensor], starts: list[int], topk_ids: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The student's input and the served ids at the positions that predict each response token.

    tokens [b, s] (s = the longest sample less one; padding 0), ids [b, s, K] and row_mask [b, s]:
    sample i's served row r (the token at start_i + r) sits at position start_i + r - 1."""
    width = max(len(ids) for ids in sequences) - 1
    tokens = torch.zeros(len(sequences), width, dtype=torch.long)
    ids = torch.zeros(len(sequences), width, K, dtype=torch.long)
    row_mask = torch.zeros(len(sequences), width, dtype=torch.bool)
    for i, (sequence, start, served) in enumerate(zip(sequences, starts, topk_ids)):
        tokens[i, : len(sequence) - 1] = sequence[:-1]
        rows = slice(start - 1, len(sequence) - 1)  # the one-position shift
        ids[i, rows] = served
        row_mask[i, rows] = True
    return {"tokens": tokens, "ids": ids, "row_mask": row_mask}


def placed_states(sequences: list[torch.Tensor], starts: list[int], states: list[torch.Tensor]) -> torch.Tensor:
    """[b, s, H_t]: sample i's served state r (the one that predicts the token at start_i + r) at
    position start_i + r - 1, zeros elsewhere (rows the row mask leaves out)."""
    width = max(len(ids) for ids in sequences) - 1
    out = torch.zeros(len(sequences), width, states[0].shape[1], dtype=states[0].dtype)
    for i, (sequence, start, rows) in enumerate(zip(sequences, starts, states)):
        out[i, start - 1:len(sequence) - 1] = rows  # the one-position shift
    return out


def next_tokens(sequences: list[torch.Tensor], width: int) -> torch.Tensor:
    """[b, s, 1]: at position p the token at p + 1 (what position p predicts; padding 0)."""
    ids = torch.zeros(len(sequences), width, 1, dtype=torch.long)
    for i, sequence in enumerate(sequences):
        ids[i, : len(sequence) - 1, 0] = sequence[1:]
    return ids


class InProcessTeacher:
    """A teacher in this process: a frozen tiny GPTModel at the student's tensor-parallel layout
    (every rank of the group runs it), scoring a `TeacherBatch` into `BatchScores` as a served
    teacher does: its own top-`top_k` with their exact tail and each actual token's log-prob."""

    def __init__(self, model: torch.nn.Module, vocab_size: int, top_k: int = K) -> None:
        self.model, self.vocab_size, self.top_k = model.eval().requires_grad_(False), vocab_size, top_k

    def score(self, batch: Any) -> Any:
        from megatron_rl_patches import topk_output_processor
        from megatron_rl_patches.teachers import BatchScores

        blank = [torch.zeros(len(ids) - start, self.top_k, dtype=torch.long)
                 for ids, start in zip(batch.sequences, batch.response_starts)]
        inputs = placed(batch.sequences, batch.response_starts, blank)
        rows, sizes = inputs["row_mask"], [len(ids) - start for ids, start in zip(batch.sequences,
                                                                                  batch.response_starts)]
        with torch.no_grad():
            own = student_forward(self.model, inputs["tokens"], output_processor_context={"row_mask": rows},
                                  output_processor=topk_output_processor(k=self.top_k, vocab_size=self.vocab_size))
            token = student_forward(self.model, inputs["tokens"],  # each actual token scored: ids [b, s, 1]
                                    output_processor=topk_output_processor(vocab_size=self.vocab_size),
                                    output_processor_context={"ids": next_tokens(batch.sequences, rows.shape[1]),
                                                              "row_mask": rows})
        ids, values, tail = (own[key][rows].split(sizes) for key in ("topk_ids", "topk_log_probs", "tail"))
        return BatchScores([t[:, 0].double() for t in token["topk_log_probs"][rows].split(sizes)], list(ids),
                           [v.double() for v in values], [t.double() for t in tail])


def student_forward(student: torch.nn.Module, tokens: torch.Tensor, **processor: Any) -> Any:
    """The student's forward on [b, s] tokens (causal, positions 0..s-1)."""
    batch, width = tokens.shape
    positions = torch.arange(width).expand(batch, width)
    causal = torch.ones(width, width, dtype=torch.bool).tril().logical_not()[None, None]
    return student(tokens, positions, causal, **processor)


def step_line(record: dict) -> str:
    """A step's line of the table `run` prints: its index, loss and response rows."""
    return f"{record['step']:>4}  {record['loss']:>8.4f}  {record['rows']:>4}"


def teacher_line(figures: dict) -> str:
    """The served teacher's figures of a step (`TeacherStep.metrics()`), printed under its line:
    what a failover shows (retries, samples failed over, hedges, the replicas taken out)."""
    taken_out = ", ".join(figures["taken_out"]) or "none"
    return (f"      teacher: samples {figures['samples']}, retries {figures['retries']}, failed over "
            f"{figures['failovers']}, hedges sent {figures['hedges_sent']} / won {figures['hedges_won']}, taken out: "
            f"{taken_out}")


def warnings_printed(stack: contextlib.ExitStack) -> None:
    """The served teacher's warnings (a replica taken out, back) printed as they come, to stdout
    beside the step lines (`warning: ...`), for the rest of the run."""
    import logging
    import sys

    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("warning: %(message)s"))
    handler.setLevel(logging.WARNING)
    logger = logging.getLogger("megatron_rl_patches.teachers")
    logger.addHandler(handler)
    stack.callback(logger.removeHandler, handler)


def train(rank: int, world_size: int, url: str | None, vocab_size: int, steps: int, seed: int,
          on_loss: Callable[[StepInputs], Any] | None = None, in_process: bool = False,
          head: str | None = None, pause: float = 0.0, echo: bool = False) -> list[dict]:
    """What every rank runs: the student at tensor parallelism `world_size`, `steps` steps against
    the server at `url` (None: none) and, with `in_process`, an in-process teacher beside it; with
    `head` (the teacher's directory; `url` a pooling server) the whole-vocabulary divergence.
    With `echo` rank 0 prints each step's line when the step ends (with a served teacher, its
    figures under it) and the served teacher's warnings as they come; `pause` seconds pass between
    steps. Returns per step its loss, the rows scored, what `on_loss` gave and the teacher step's
    figures (`TeacherStep.metrics()`)."""
    from megatron.core import parallel_state

    import megatron_rl_patches
    from megatron_rl_patches import divergence_output_processor, topk_kl, topk_output_processor
    from megatron_rl_patches.teachers import TeacherBatch, TeacherStep, build_teachers, megatron_host
    from megatron_rl_patches.testing import megatron_cpu as kit

    megatron_rl_patches.apply(only="gpt_output_processor")  # the processor keyword on megatron-core < 0.18
    records = []
    with kit.megatron_on_cpu(tensor_parallel=world_size, seed=seed), contextlib.ExitStack() as stack:
        config = kit.tiny_gpt_config(init_method_std=0.3)
        rows_padded = padded(vocab_size, world_size)
        host = megatron_host(parallel_state, vocab_size)  # the tensor-parallel group shares, the job agrees
        # built from its entry through its kind, connected by each group's asking rank (the server's
        # tokenizer is the student's: the entry says so and names the vocabulary)
        entry = f"{url};engine=vllm;same_tokenizer;vocab={vocab_size}" + (f";head={head}" if head else "")
        if echo and rank == 0:
            warnings_printed(stack)
        teachers: list[Any] = [] if url is None else build_teachers(entry, host, top_k=K)
        for teacher in teachers:
            stack.callback(teacher.close)
        if in_process:  # a frozen model of the student's shape, another seed: the same on 1 and 2 ranks
            teachers.append(InProcessTeacher(kit.build_tiny_gpt(config, vocab_size=rows_padded,
                                                                seq_length=max(LENGTHS), seed=seed + 1), vocab_size))
        step_teachers = TeacherStep(teachers, host)
        student = kit.build_tiny_gpt(config, vocab_size=rows_padded, seq_length=max(LENGTHS), seed=seed)
        optimizer = torch.optim.Adam(student.parameters(), lr=LR)
        for step in range(steps):
            sequences = rollouts(step, seed, vocab_size)
            samples = TeacherBatch(sequences, list(PROMPTS))
            for ids, start in zip(sequences, PROMPTS):  # as the rollout finishes each sample: asked at once,
                step_teachers.add(TeacherBatch([ids], [start]))  # on the first rank of each tensor-parallel group
            every = step_teachers.collect()  # here before the forward: the teachers' ids are the forward's input
            losses = []
            if head is not None:  # the whole vocabulary: the served states through the teacher's head
                (scores,) = every
                inputs = placed(sequences, samples.response_starts, scores.topk_ids)  # tokens and row mask
                rows = inputs["row_mask"]
                weight = teachers[0].head.weight  # this rank's shard, at the student's padded layout
                processor = divergence_output_processor(divergence="forward_kl", vocab_size=vocab_size)
                divergence = student_forward(student, inputs["tokens"], output_processor=processor,
                                             output_processor_context={
                                                 "teacher_hidden": placed_states(sequences, samples.response_starts,
                                                                                 scores.hidden_states),
                                                 "teacher_weight": weight, "row_mask": rows})
                losses.append(divergence[rows].mean())
            for scores in every if head is None else []:  # each teacher's own ids scored by the student
                inputs = placed(sequences, samples.response_starts, scores.topk_ids)
                processor = topk_output_processor(vocab_size=vocab_size)  # scores the context's ids
                out = student_forward(student, inputs["tokens"], output_processor=processor,
                                      output_processor_context={"ids": inputs["ids"], "row_mask": inputs["row_mask"]})
                rows = inputs["row_mask"]  # [b, s] -> the response rows in sample order, as the teacher's
                losses.append(topk_kl(out["topk_log_probs"][rows], out["tail"][rows],
                                      torch.cat(scores.topk_log_probs).float(),
                                      torch.cat(scores.tail_log_probs).float(), divergence="forward_kl").mean())
            loss = torch.stack(losses).mean()
            checked = None if on_loss is None else on_loss(
                StepInputs(step, student, inputs["tokens"], samples, every[0], loss.detach(), vocab_size, every,
                           None if head is None else teachers[0].head.weight))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            records.append({"step": step, "loss": loss.item(), "rows": int(rows.sum()), "checked": checked,
                            "teacher": step_teachers.metrics()})  # the step's figures: samples, waits, replicas
            if echo and rank == 0:
                print(step_line(records[-1]), flush=True)
                if url is not None:
                    print(teacher_line(records[-1]["teacher"]), flush=True)
            if pause and step + 1 < steps:
                time.sleep(pause)  # time to stop a replica (or a server) by hand and watch the next step
    return records


def main(url: str | None, vocab_size: int, tp: int = 1, steps: int = STEPS, seed: int = 0,
         on_loss: Callable[[StepInputs], Any] | None = None, in_process: bool = False,
         head: str | None = None, pause: float = 0.0, echo: bool = False) -> list[dict]:
    """Train at tensor parallelism `tp` (1 or 2 gloo ranks) against the server at `url` (a
    teacher's replicas: their URLs joined by '|') and, with `in_process`, an in-process teacher
    (alone where `url` is None); with `head` (the teacher's Hugging Face directory, `url` its
    pooling server) the whole-vocabulary divergence instead of top-k. `pause`: seconds between
    steps; `echo`: each step's line printed when it ends. Returns rank 0's records (every rank
    computes the same loss). `on_loss` must be importable (it runs in the ranks)."""
    from megatron_rl_patches.testing.multirank import run_multirank

    for name, value, low in (("tp", tp, 1), ("steps", steps, 1), ("seed", seed, 0), ("vocab_size", vocab_size, K)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")
    if not isinstance(in_process, bool):
        raise TypeError(f"in_process must be True or False, got {in_process!r}")
    if isinstance(pause, bool) or not isinstance(pause, (int, float)) or not math.isfinite(pause) or pause < 0:
        raise ValueError(f"pause must be a finite number of seconds >= 0, got {pause!r}")
    if url is None and not in_process:
        raise ValueError("no teacher: pass a server's url, or in_process=True (an in-process teacher alone)")
    if head is not None and (url is None or in_process or not isinstance(head, str) or not head):
        raise ValueError(f"head={head!r}: the whole-vocabulary route takes the teacher's Hugging Face directory (a "
                         "str) beside its pooling server's url, without in_process")
    ranks = run_multirank(train, tp, url, vocab_size, steps, seed, on_loss, in_process, head, pause, echo,
                          timeout=600 + pause * steps)
    return ranks[0]


def tiny_teacher(directory: str, vocab_size: int) -> None:
    """A tiny random Qwen3 of `vocab_size` words with its word-level tokenizer (vLLM's CPU
    attention needs a head size of 32 or more)."""
    from megatron_rl_patches.testing.hf_checkpoints import save_tiny_hf, save_word_tokenizer

    save_tiny_hf(directory, "qwen3", seed=3, hidden_size=64, head_dim=32, intermediate_size=96,
                 max_position_embeddings=256, vocab_size=vocab_size)
    save_word_tokenizer(directory, vocab_size)


def run(args: argparse.Namespace) -> list[dict]:
    """The run the command line asks for: its header, then each step's line as the step ends."""
    served = "a served teacher's whole vocabulary (its head)" if args.head else f"a served teacher's top-{K} + tail"
    replicas = 0 if args.url is None else len(args.url.split("|"))
    if replicas > 1:
        served += f" ({replicas} replicas)"
    teachers = [served] * (args.url is not None) + [f"an in-process teacher's top-{K} + tail"] * args.in_process
    print(f"student GPT (vocab {args.vocab_size}, padded to {padded(args.vocab_size, args.tp)}) at TP={args.tp}, "
          f"{' and '.join(teachers)}, {len(LENGTHS)} samples a step, Adam lr {LR}")
    print(f"{'step':>4}  {'loss':>8}  {'rows':>4}", flush=True)
    return main(args.url, args.vocab_size, args.tp, args.steps, args.seed, in_process=args.in_process,
                head=args.head or None, pause=args.pause, echo=True)


def run_or_say(args: argparse.Namespace) -> list[dict]:
    """`run`, a failure of the run's ranks (a teacher that does not answer, a refused entry) said
    in one line naming it (`--traceback`: the ranks' tracebacks)."""
    from megatron_rl_patches.testing.multirank import RanksFailed

    try:
        return run(args)
    except RanksFailed as failed:
        if args.traceback:
            raise
        raise SystemExit(f"served_teacher_loop.py: the run failed: {failed.summary} (--traceback: the ranks' "
                         "tracebacks)") from None


def save_teacher(directory: str, vocab_size: int) -> None:
    """`--save-teacher DIR`: the example's tiny teacher written to DIR, for a server of your own."""
    tiny_teacher(directory, vocab_size)
    print(f"{directory}: a tiny random Qwen3 teacher ({vocab_size} words; config.json, model.safetensors, "
          "tokenizer.json), small enough for vLLM's CPU build to serve")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--url", help="a running server of a model with the student's tokenizer")
    where.add_argument("--vllm-python", help="vLLM's interpreter: serve a tiny teacher for the run")
    where.add_argument("--save-teacher", metavar="DIR", help="only write the tiny teacher to DIR (for vLLM to serve)")
    parser.add_argument("--in-process", action="store_true", help="an in-process teacher beside (or instead of) it")
    parser.add_argument("--head", nargs="?", const="", default=None, metavar="DIR",
                        help="the whole vocabulary: a pooling server's hidden states through the teacher's head (with "
                             "--url: its Hugging Face directory DIR; with --vllm-python: the example's own teacher)")
    parser.add_argument("--vocab-size", type=int, default=1001, help="the teacher's (and student's) vocabulary")
    parser.add_argument("--tp", type=int, default=1, choices=(1, 2))
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pause", type=float, default=0.0, metavar="SECONDS",
                        help="wait between steps (time to stop a replica by hand and watch the run go on)")
    parser.add_argument("--traceback", action="store_true", help="a failed run's ranks' tracebacks, not one line")
    cli = parser.parse_args()
    if cli.save_teacher is not None:
        save_teacher(cli.save_teacher, cli.vocab_size)
        raise SystemExit(0)
    if not (math.isfinite(cli.pause) and cli.pause >= 0):
        parser.error(f"--pause takes seconds >= 0, got {cli.pause}")
    if cli.head is not None and cli.in_process:
        parser.error("--head is the served teacher's whole vocabulary: run it without --in-process")
    if cli.vllm_python is None:
        if cli.url is None and not cli.in_process:
            parser.error("name a teacher: --url, --vllm-python or --in-process")
        if cli.head == "":
            parser.error("--head DIR: with --url, name the served teacher's Hugging Face directory")
        run_or_say(cli)
    else:
        from megatron_rl_patches.testing.vllm_server import vllm_server

        with tempfile.TemporaryDirectory() as root:
            tiny_teacher(os.path.join(root, "teacher"), cli.vocab_size)
            if cli.head is not None:  # the example's own teacher, served by a pooling server
                cli.head = os.path.join(root, "teacher")
            log = os.path.join(root, "vllm.log")
            print(f"starting a vLLM server of the tiny teacher ({'a pooling server, ' if cli.head else ''}up to 2 "
                  f"minutes on CPU; its log: {log})", flush=True)
            with vllm_server(cli.vllm_python, os.path.join(root, "teacher"), log,
                             extra=POOLING if cli.head else ()) as server:
                print(f"served at {server.url}", flush=True)
                cli.url = server.url
                run_or_say(cli)
