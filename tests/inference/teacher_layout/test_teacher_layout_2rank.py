"""A Hugging Face teacher at its own layout over the student's ranks (the 2-rank gloo world that
slime_opd's checks share, `layout_worlds.two_rank_world`, spawned once): the student at TP=1 x DP=2
(parallel_state), the teacher at TeacherLayout(tp=2). Each rank's rows (of another count and length
than the other rank's) are scored by the TP=2 teacher to the 1-rank teacher's log-probs (1e-6,
relative 1e-6: one fp32 ulp); each rank reads about half the checkpoint's bytes; a layout the world
cannot hold, bad input on one rank and ep > 1 are refused on every rank, the world still usable
after (no hang). The same rows through TeacherLayout(pp=2) (rank 0 the first stage, rank 1 the
last; an untied and a tied output layer), and a stage that fails mid-pass: every rank raises,
none waits. On a megatron-core without ProcessGroupCollection (0.13.1) the layout is refused by
name."""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import pytest
import torch

from megatron_rl_patches.testing.invariance import counting_invariant_calls
from tests.inference.teacher_layout.hostile_layout import build_cases, pp2_cases, tp2_cases
from tests.inference.teacher_layout.layout_worlds import close, read_shares, served, two_rank_world

pytestmark = [pytest.mark.megatron, pytest.mark.multirank, pytest.mark.slow]

VOCAB = 1001
# each rank's rows: (count, length); rank 0 shorter and fewer
ROWS = ((2, 7), (3, 12))


def _rows(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    count, length = ROWS[rank]
    gen = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, VOCAB, (count, length + 1), generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _ids(rank: int) -> torch.Tensor:
    """k=4 distinct ids per position of this rank's rows (the student's top-k in OPD)."""
    count, length = ROWS[rank]
    base = torch.randint(0, VOCAB, (count, length, 1), generator=torch.Generator().manual_seed(300 + rank))
    return (base + 97 * torch.arange(4)) % VOCAB


def _one_rank_teacher(chunks, tokens, labels) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The teacher built whole on this rank (the student's TP=1 groups): its log-probs of the rows,
    and its top-k log-probs at _ids and their tail."""
    from megatron_rl_patches.ops import log_probs_and_entropy, topk_logprobs
    from megatron_rl_patches.testing.megatron_cpu import make_batch

    rows, length = tokens.shape
    batch = make_batch(batch_size=rows, seq_length=length, vocab_size=VOCAB)
    with torch.no_grad():
        logits = chunks[0](tokens, batch["position_ids"], batch["attention_mask"])
        flat = logits.reshape(rows * length, -1)
        log_probs, _ = log_probs_and_entropy(flat, labels.reshape(-1), vocab_size=VOCAB)
        ids = _ids(torch.distributed.get_rank())
        logp, tail = topk_logprobs(flat, ids.reshape(rows * length, -1), vocab_size=VOCAB)
    return log_probs.view(rows, length), logp.view(ids.shape), tail.view(rows, length)


def _refusal(call) -> str | None:
    try:
        call()
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def api_checks(rank: int, world_size: int, root: str) -> dict:
    import torch.distributed as dist
    from megatron.core import package_info

    from megatron_rl_patches import build_inference_model_from_hf
    from megatron_rl_patches.inference import TeacherLayout, score_at_layout, topk_at_layout
    from megatron_rl_patches.testing.file_reads import FileReads
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    results: dict = {"version": package_info.__version__}
    try:
        from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: F401
        results["collections"] = True
    except ImportError:
        results["collections"] = False
    tokens, labels = _rows(rank)
    with megatron_on_cpu():  # the student: TP=1 x DP=2
        layout = TeacherLayout(tp=2)
        try:
            with FileReads(root) as reads:
                chunks = build_inference_model_from_hf(root, dtype=torch.float32, layout=layout)
        except ValueError as exc:  # a megatron-core without ProcessGroupCollection
            results["unsupported"] = str(exc)
            dist.barrier()
            return results
        results["reads"] = {name: flags.copy() for name, flags in reads.read.items()}
        model = chunks[0]
        results["vocab_shard"] = model.embedding.word_embeddings.weight.shape[0]
        results["qkv_rows"] = model.decoder.layers[0].self_attention.linear_qkv.weight.shape[0]
        results["scores"] = score_at_layout(chunks, tokens, labels, layout=layout)
        whole = build_inference_model_from_hf(root, dtype=torch.float32)  # the 1-rank teacher, per rank
        results["reference"], results["topk_ref"], results["tail_ref"] = _one_rank_teacher(whole, tokens, labels)
        results["topk"], results["tail"] = topk_at_layout(chunks, tokens, _ids(rank))
        results.update(_full_vocab_checks(chunks, whole, tokens, "tp2"))
        # a rank with no rows: the other rank's rows still scored, this one gets [0, 0]
        empty = (torch.zeros(0, 0, dtype=torch.long),) * 2
        results["empty_or_not"] = score_at_layout(chunks, *(empty if rank == 0 else (tokens, labels)))
        # bad input on rank 1 only: refused on both ranks, then the world goes on
        bad = tokens.float() if rank == 1 else tokens
        results["bad_input"] = _refusal(lambda: score_at_layout(chunks, bad, labels))
        results["tp3"] = _refusal(lambda: build_inference_model_from_hf(root, layout=TeacherLayout(tp=3)))
        results["ep2"] = _refusal(lambda: TeacherLayout(ep=2))
        results["not_a_layout"] = _refusal(lambda: build_inference_model_from_hf(root, layout={"tp": 2}))
        results["bad_prefetch"] = _refusal(lambda: build_inference_model_from_hf(root, layout=layout,
                                                                                  residency="stream", prefetch=-1))
        results["other_layout"] = _refusal(lambda: score_at_layout(chunks, tokens, labels,
                                                                   layout=TeacherLayout(tp=1)))
        dist.barrier()  # every rank got here: nothing above left a rank waiting
        with counting_invariant_calls() as default_calls:
            results["after"] = score_at_layout(chunks, tokens, labels)
            topk_at_layout(chunks, tokens, _ids(rank))  # the default mode's top-k, counted
        # the student's invariant mode, given (a teacher's own config is never read): rank 1's rows
        # amid rank 0's and with rank 0 empty
        with counting_invariant_calls() as invariant_calls:
            results["invariant"] = score_at_layout(chunks, tokens, labels, invariant=True)
        results["invariant_alone"] = score_at_layout(chunks, *(empty if rank == 0 else (tokens, labels)),
                                                     invariant=True)
        with counting_invariant_calls() as invariant_topk_calls:
            results["invariant_topk"] = topk_at_layout(chunks, tokens, _ids(rank), invariant=True)
        results["invariant_code_calls"] = (default_calls.count, invariant_calls.count, invariant_topk_calls.count)

        started = time.perf_counter()  # issue 63 items 4-6: a rank's own mistake, bounded (hostile_layout.py)
        results["hostile"] = {**tp2_cases(rank, chunks, whole, tokens, labels, _ids(rank), VOCAB),
                              **build_cases(rank, root)}
        results["hostile_seconds"] = time.perf_counter() - started
        results.update(_pipeline_checks(root, tokens, labels))
    return results


def _failing(chunk, failing: bool):
    """`chunk` whose forward raises on this rank when `failing` (a stage that fails mid-pass)."""
    def boom(*args, **kwargs):
        raise RuntimeError("this stage failed on purpose")

    if failing:
        chunk.forward = boom
    return chunk


def _pipeline_checks(root: str, tokens: torch.Tensor, labels: torch.Tensor) -> dict:
    """TeacherLayout(pp=2): rank 0 the first stage, rank 1 the last (DP=1): log-probs and top-k of
    each rank's rows; a stage whose forward raises (the first, then the last) makes every rank
    raise, the world still usable after."""
    import torch.distributed as dist

    from megatron_rl_patches import build_inference_model_from_hf
    from megatron_rl_patches.inference import TeacherLayout, score_at_layout, topk_at_layout
    from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, write_tiny_checkpoint

    rank = dist.get_rank()
    chunks = build_inference_model_from_hf(root, dtype=torch.float32, layout=TeacherLayout(pp=2))
    results: dict = {"pp2_layers": [int(layer.layer_number) for layer in chunks[0].decoder.layers],
                     "pp2_scores": score_at_layout(chunks, tokens, labels),
                     "pp2_topk": topk_at_layout(chunks, tokens, _ids(rank))}
    results.update(_full_vocab_checks(chunks, build_inference_model_from_hf(root, dtype=torch.float32), tokens, "pp2"))
    for stage in (0, 1):
        try:
            score_at_layout([_failing(chunks[0], rank == stage)], tokens, labels)
            results[f"pp2_stage{stage}_fails"] = None
        except RuntimeError as exc:
            results[f"pp2_stage{stage}_fails"] = str(exc)
        finally:
            chunks[0].__dict__.pop("forward", None)
    dist.barrier()
    results["pp2_after"] = score_at_layout(chunks, tokens, labels)
    started = time.perf_counter()
    results["pp2_hostile"] = pp2_cases(rank, chunks, tokens, labels, VOCAB)
    results["pp2_hostile_seconds"] = time.perf_counter() - started
    # a tied output layer: the last stage reads it from the embedding's tensor (nothing synchronized)
    tied = Path(tempfile.mkdtemp()) / "tied"  # each rank its own copy of the same checkpoint
    write_tiny_checkpoint(tied, tiny_hf_config("qwen3", tie_word_embeddings=True), seed=7)
    results["tied_reference"] = _one_rank_teacher(build_inference_model_from_hf(tied, dtype=torch.float32),
                                                  tokens, labels)[0]
    piped = build_inference_model_from_hf(tied, dtype=torch.float32, layout=TeacherLayout(pp=2))
    results["tied_pp2"] = score_at_layout(piped, tokens, labels)
    results.update(_full_vocab_checks(piped, build_inference_model_from_hf(tied, dtype=torch.float32), tokens,
                                      "tied_pp2"))
    return results


def _full_vocab_checks(chunks, whole, tokens, name: str) -> dict:
    """hidden_at_layout @ output_weight_at_layout.T against the whole teacher's logits on this rank;
    lm_head_divergence (a random student, reverse KL) from them against float64 from those logits."""
    from megatron_rl_patches import lm_head_divergence
    from megatron_rl_patches.inference import hidden_at_layout, output_weight_at_layout
    from megatron_rl_patches.testing.megatron_cpu import make_batch

    rows, length = tokens.shape
    batch = make_batch(batch_size=rows, seq_length=length, vocab_size=VOCAB)
    hidden, weight = hidden_at_layout(chunks, tokens), output_weight_at_layout(chunks)
    with torch.no_grad():
        want = whole[0](tokens, batch["position_ids"], batch["attention_mask"]).double()
    generator = torch.Generator().manual_seed(5)
    student_hidden = torch.randn(rows * length, 24, generator=generator, dtype=torch.float64)
    student_weight = torch.randn(weight.shape[0], 24, generator=generator, dtype=torch.float64) * 0.3
    got = lm_head_divergence(student_hidden, student_weight, hidden.reshape(rows * length, -1).double(),
                             weight.double(), divergence="reverse_kl", vocab_size=VOCAB)
    p = torch.log_softmax((student_hidden @ student_weight.T)[:, :VOCAB], -1)
    q = torch.log_softmax(want.reshape(rows * length, -1)[:, :VOCAB], -1)
    return {f"{name}_logits_error": ((hidden.double() @ weight.double().T) - want).abs().max().item(),
            f"{name}_weight_shape": tuple(weight.shape),
            f"{name}_divergence_error": (got - (p.exp() * (p - q)).sum(-1)).abs().max().item()}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return two_rank_world(tmp_path_factory, "api")


@pytest.mark.parametrize("name", ["tp2", "pp2", "tied_pp2"])
def test_full_vocabulary_divergences_read_the_teachers_hidden_states_and_whole_output_weight(world, name):
    """A teacher at TP=2 / PP=2 (tied too): each rank's hidden states at its own rows times the
    gathered output weight are the whole teacher's logits (1e-5), and lm_head_divergence from them
    equals float64 reverse KL from those logits (1e-6): no [T, V] crossed ranks."""
    results = world
    served(results)
    for result in results:
        assert result[f"{name}_weight_shape"][0] >= VOCAB
        assert result[f"{name}_logits_error"] < 1e-5, result[f"{name}_logits_error"]
        assert result[f"{name}_divergence_error"] < 1e-6, result[f"{name}_divergence_error"]


def test_each_rank_gets_the_one_rank_teachers_log_probs_of_its_own_rows(world):
    served(world)
    for rank, result in enumerate(world):
        assert result["scores"].shape == ROWS[rank]
        # the TP=2 split sums the row-parallel halves in another order: about 1 fp32 ulp of a log-prob near -8
        error = (result["scores"] - result["reference"]).abs() - 1e-6 * result["reference"].abs()
        assert error.max().item() <= 1e-6, (rank, error.max().item())
        assert torch.equal(result["after"], result["scores"])  # the same rows scored again after the refusals
    assert world[0]["empty_or_not"].shape == (0, 0)
    assert torch.equal(world[1]["empty_or_not"], world[1]["scores"])  # the other rank had no rows


def test_the_students_invariant_mode_reaches_the_teachers_ops(world):
    served(world)
    for result in world:
        # the invariant code ran for the invariant calls only (counted: the fixed-point sums and the
        # default mode's may round alike on some CPU); the same values
        default, scores, topk = result["invariant_code_calls"]
        assert default == 0 and scores > 0 and topk > 0, result["invariant_code_calls"]
        torch.testing.assert_close(result["invariant"], result["scores"], rtol=0, atol=2e-6)
        torch.testing.assert_close(result["invariant_topk"][0], result["topk"], rtol=0, atol=2e-6)
    assert torch.equal(world[1]["invariant_alone"], world[1]["invariant"])


def test_each_rank_gets_the_one_rank_teachers_topk_log_probs_and_tail(world):
    served(world)
    for rank, result in enumerate(world):
        assert result["topk"].shape == (*ROWS[rank], 4) and result["tail"].shape == ROWS[rank]
        for key in ("topk", "tail"):
            reference = result[f"{key}_ref"]
            error = (result[key] - reference).abs() - 1e-6 * reference.abs()
            assert error.max().item() <= 1e-6, (rank, key, error.max().item())


def test_each_rank_holds_and_reads_half_of_the_teacher(world):
    served(world)
    for result in world:
        assert result["vocab_shard"] == 512  # 1001 padded to 1024, half per rank
        assert result["qkv_rows"] == (4 + 2 * 2) * 8 // 2  # q, k, v heads of 8, half per rank
    read_shares(world, "teacher at tp=2")


def test_layouts_the_world_or_the_build_cannot_hold_are_refused_on_every_rank(world):
    for result in world:
        if "unsupported" in result:
            continue
        assert "TeacherLayout(tp=3, pp=1, ep=1) cannot be laid over 2 rank(s)" in result["tp3"]
        assert result["ep2"].startswith("ValueError: TeacherLayout(ep=2)")
        assert result["not_a_layout"].startswith("TypeError: layout must be a TeacherLayout")
        # swap / stream are served at a layout (test_teacher_layout_residency.py); their bad arguments are not
        assert result["bad_prefetch"].startswith("ValueError: prefetch must be an int >= 0")
        assert "differs from the layout the chunks were built at" in result["other_layout"]
        assert result["bad_input"].startswith("TypeError: tokens must be an integer tensor")
        assert "refused on rank(s) [1] of the teacher replica [0, 1], so on every rank" in result["bad_input"]


def test_a_two_stage_teacher_pipeline_gives_each_rank_the_one_rank_teachers_scores(world):
    served(world)
    for rank, result in enumerate(world):
        assert result["pp2_layers"] == [rank + 1]  # layer 1 on the first stage, layer 2 on the last
        for key, want in (("pp2_scores", result["reference"]), ("pp2_after", result["reference"]),
                          ("tied_pp2", result["tied_reference"])):
            assert result[key].shape == ROWS[rank] and close(result[key], want) <= 1e-6, (rank, key)
        logp, tail = result["pp2_topk"]
        assert close(logp, result["topk_ref"]) <= 1e-6 and close(tail, result["tail_ref"]) <= 1e-6, rank


def test_a_failing_pipeline_stage_makes_every_rank_raise_none_waits(world):
    served(world)
    for stage in (0, 1):
        for rank, result in enumerate(world):
            message = result[f"pp2_stage{stage}_fails"]
            if rank == stage:
                assert message == "this stage failed on purpose"
            else:
                assert f"the teacher's pipeline stage {stage} (rank {stage} of the pipeline [0, 1]) failed" in message


def test_a_megatron_core_without_process_group_collections_refuses_by_name(world):
    for result in world:
        if result["collections"]:
            assert "unsupported" not in result
        else:  # 0.13.1: ModelCommProcessGroups only
            assert "needs megatron-core's ProcessGroupCollection" in result["unsupported"]
            assert result["version"] in result["unsupported"]
