"""For `../shared/tools/ab-bench REV_A REV_B -- python tools/ab/slime_opd_step.py`: slime's top-k OPD
step, timed. slime 624b824a's real `MegatronTrainRayActor.train_actor` (the slime lane's kit:
slime's log-probs, the teachers' passes, `train()`), one rank, the lane's tiny GPT, with a
snapshot teacher and, where MRP_VLLM_PYTHON names vLLM's interpreter (.lanes/vllm/bin/python), a
teacher served by a real vLLM CPU server (started once, outside the timing; its own top-k are the
buckets, as the served lane runs it). `--rollouts N` train_actor calls in a row; the first warms up.
One JSON line: the median seconds of a later step per case (snapshot teachers; served + snapshot).

Run as the slime lane runs (`make test-slime`'s PYTHONPATH), e.g.

    PYTHONPATH=.lanes/slime/slime:.lanes/slime/megatron-lm:.lanes/slime/deps \\
    MRP_VLLM_PYTHON=$PWD/.lanes/vllm/bin/python ../shared/tools/ab-bench -n 3 main HEAD -- \\
        .venv/bin/python tools/ab/slime_opd_step.py

Under ab-bench the package and the lane's kit come from AB_SRC (the revision's tree)."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.environ.get("AB_SRC") or str(Path(__file__).resolve().parents[2])
LANE = os.path.join(ROOT, "tests", "integrations", "slime", "lane")
VOCAB = 64  # the lane's tiny GPT's vocabulary (slime_kit.VOCAB), the served model's too
SHAPE = dict(hidden_size=64, head_dim=32, intermediate_size=96, max_position_embeddings=256, vocab_size=VOCAB)


@contextlib.contextmanager
def served_teacher(python: str, root: Path):
    """A tiny Qwen3 checkpoint served by vLLM's CPU build: (its URL, its directory)."""
    from megatron_rl_patches.testing.hf_checkpoints import (
        save_word_tokenizer,
        tiny_hf_config,
        transformers_layout,
        write_tiny_checkpoint,
    )
    from megatron_rl_patches.testing.vllm_server import vllm_server

    config = {**transformers_layout(tiny_hf_config("qwen3", **SHAPE)), "architectures": ["Qwen3ForCausalLM"]}
    write_tiny_checkpoint(root / "qwen3", config, seed=3)
    save_word_tokenizer(root / "qwen3", VOCAB)
    with vllm_server(python, root / "qwen3", root / "vllm.log", max_model_len=256, max_logprobs=20) as server:
        yield server.url, str(root / "qwen3")


class ProcessClock:
    """`time` as slime_ranks reads it, with `perf_counter` the process's CPU seconds (every thread)."""

    def __getattr__(self, name: str):
        return time.process_time if name == "perf_counter" else getattr(time, name)


def cpu_timed_train_actor(rank: int, world_size: int, *args):
    """slime_ranks.opd_train_actor with its step times in CPU seconds: on a machine whose cores are
    shared, the CPU time of one rank's step moves far less with the other jobs than its wall time."""
    import slime_ranks

    slime_ranks.time = ProcessClock()
    return slime_ranks.opd_train_actor(rank, world_size, *args)


def step_seconds(rollouts: int, served: dict | None, clock: str = "wall") -> float:
    """The median seconds (wall, or the rank's CPU seconds) of the train_actor calls after the first, one rank."""
    import slime_ranks

    from megatron_rl_patches.testing.multirank import run_multirank

    fn = cpu_timed_train_actor if clock == "cpu" else slime_ranks.opd_train_actor
    (rank,) = run_multirank(fn, 1, 1, 1, 1, None, None, (), rollouts, None, 1, None, None, served, timeout=900)
    return statistics.median(rank["step_seconds"][1:] or rank["step_seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=4, help="train_actor calls per case (the first warms up)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time each step by the wall clock or by the rank's CPU seconds (a shared machine)")
    options = parser.parse_args()
    sys.path.insert(0, LANE)
    import slime_megatron_patch
    import slime_standins

    from megatron_rl_patches.testing import multirank

    slime_megatron_patch.install()  # as the lane's conftest: slime's GPT-model hunks, then its stand-ins
    slime_standins.install()
    multirank.use_spawn()
    result = {"snapshot_step_s": step_seconds(options.rollouts, None, options.clock)}
    python = os.environ.get("MRP_VLLM_PYTHON", "")
    if python:
        with tempfile.TemporaryDirectory() as tmp, served_teacher(python, Path(tmp)) as (url, directory):
            served = {"entries": f"{url};engine=vllm,teacher-a", "student": directory}
            result["served_step_s"] = step_seconds(options.rollouts, served, options.clock)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
