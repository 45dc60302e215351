"""A teacher head at the student's layout whatever the tensor-parallel size: `TeacherHead.from_hf`
with a one-rank group padded as Megatron pads the student's (a multiple of 128 x TP, at TP=1 too),
and a `;head=DIR` entry built by `build_teachers` for a Megatron host cut and padded for that host's
student (its tensor-parallel group, its padding) — one 2-rank gloo world: TP=1 (each rank its own
one-rank group), then TP=2; the server a stand-in answering vLLM's binary `/pooling` route."""
from __future__ import annotations

import json

import pytest
import torch

from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, write_tiny_checkpoint
from megatron_rl_patches.testing.multirank import run_multirank
from tests.teachers.local_servers import url_of, vllm_like

VOCAB, WIDTH = 1001, 32  # the kit's tiny qwen3 config


def pooling(body):
    """A pooling server's binary reply: zero states of the head's width, one per input id."""
    raw = torch.zeros(len(body["input"]), WIDTH).numpy().tobytes()
    item = {"index": 0, "embed_dtype": "float32", "endianness": "little", "start": 0, "end": len(raw),
            "shape": [len(body["input"]), WIDTH]}
    return 200, (raw, {"metadata": json.dumps({"data": [item]})})


def shapes(head) -> tuple:
    return tuple(head.weight.shape), head.padded_vocab_size, head.first_id, head.vocab_size


def layouts(rank: int, world_size: int, directory: str, url: str) -> dict:
    from megatron.core import parallel_state

    from megatron_rl_patches.teachers import TeacherHead, build_teachers, megatron_host
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    entry = f"{url};engine=vllm;head={directory};same_tokenizer;vocab={VOCAB}"
    out: dict = {}
    for tp in (1, 2):
        with megatron_on_cpu(tensor_parallel=tp):
            group = parallel_state.get_tensor_model_parallel_group()
            out[f"from_hf tp={tp}"] = shapes(TeacherHead.from_hf(directory, tp_group=group))
            (teacher,) = build_teachers(entry, megatron_host(parallel_state, VOCAB), top_k=4)
            out[f"entry tp={tp}"] = shapes(teacher.head)
            out[f"entry tp={tp} group"] = teacher.head.tp_group is group
            teacher.close()
            host = megatron_host(parallel_state, VOCAB, make_vocab_size_divisible_by=64)
            (teacher,) = build_teachers(entry, host, top_k=4)
            out[f"entry tp={tp} by 64"] = shapes(teacher.head)
            teacher.close()
    return out


@pytest.mark.multirank
def test_a_head_is_padded_and_cut_as_the_hosts_student_at_one_and_two_ranks(tmp_path):
    write_tiny_checkpoint(tmp_path / "teacher", tiny_hf_config("qwen3"), seed=1)
    with vllm_like(pooling=pooling) as server:
        ranks = run_multirank(layouts, 2, str(tmp_path / "teacher"), url_of(server), timeout=300)
    for rank, out in enumerate(ranks):
        # TP=1: a one-rank group pads to a multiple of 128 (1024), as Megatron pads the student's
        assert out["from_hf tp=1"] == ((1024, WIDTH), 1024, 0, VOCAB), out
        assert out["entry tp=1"] == ((1024, WIDTH), 1024, 0, VOCAB), out
        # TP=2: this rank's half of 1024 rows
        assert out["from_hf tp=2"] == ((512, WIDTH), 1024, 512 * rank, VOCAB), out
        assert out["entry tp=2"] == ((512, WIDTH), 1024, 512 * rank, VOCAB), out
        assert out["entry tp=1 group"] and out["entry tp=2 group"]
        # the host's own padding (--make-vocab-size-divisible-by 64): 1024 at TP=1, 1024 at TP=2 (64 x 2)
        assert out["entry tp=1 by 64"] == ((1024, WIDTH), 1024, 0, VOCAB), out
        assert out["entry tp=2 by 64"] == ((512, WIDTH), 1024, 512 * rank, VOCAB), out


@pytest.mark.parametrize("padded", [128, 1024])
def test_a_head_larger_than_the_hosts_padded_vocabulary_is_refused_naming_both(tmp_path, padded):
    from megatron_rl_patches.teachers import LoopHost
    from megatron_rl_patches.teachers.head.for_host import head_for_host

    write_tiny_checkpoint(tmp_path / "teacher", tiny_hf_config("qwen3"), seed=1)
    host = LoopHost(vocab_size=100, padded_vocab_size=padded)
    if padded == 128:
        with pytest.raises(ValueError, match=r"entry X: the teacher head of .* has 1001 vocabulary rows, more than "
                                             r"the student's padded vocabulary of 128"):
            head_for_host(str(tmp_path / "teacher"), host, "entry X")
    else:
        assert head_for_host(str(tmp_path / "teacher"), host, "entry X").weight.shape == (1024, WIDTH)


def test_a_hosts_padding_below_its_vocabulary_is_refused():
    from megatron_rl_patches.teachers import LoopHost

    with pytest.raises(ValueError, match="padded_vocab_size=64"):
        LoopHost(vocab_size=100, padded_vocab_size=64)
