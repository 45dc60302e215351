"""Issue 63 items 4-6, run inside the existing teacher-layout worlds (no world of their own): a
rank's own mistake at a teacher layout (an id past the vocabulary, a bad or different argument,
another invariant mode, chunks of the student's layout, a missing path at the build) must be the
same clear error on every rank of the group, never a hang nor numbers combined from two values.

Each case runs under a bound: every process group of the world gets a gloo timeout of BOUND
seconds while the cases run, so a rank left waiting in a collective fails within seconds
("Timed out") instead of holding the world until its deadline. A case's record is
(error type or "ok", message, seconds); the test modules assert on them."""
from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

BOUND = 15.0  # seconds a rank may wait in one collective while the cases run
LONG = datetime.timedelta(minutes=30)  # gloo's default, restored after
INVARIANT = "MEGATRON_RL_PATCHES_INVARIANT"


@contextlib.contextmanager
def bounded(layouts: list[Any]) -> Iterator[None]:
    """Every group of the default world and of the teacher layouts built for `layouts` times out
    after BOUND seconds inside the block (a hang becomes an error within seconds)."""
    import torch.distributed as dist

    from megatron_rl_patches.inference.teacher_layout.groups import built_groups

    groups = [dist.group.WORLD]
    for layout in layouts:
        built = built_groups(layout)
        if built is not None:
            groups += [built.tp_group, built.pp_group, built.replica_group, built.dp_group]
    for group in groups:
        group.set_timeout(datetime.timedelta(seconds=BOUND))
    try:
        yield
    finally:
        for group in groups:
            group.set_timeout(LONG)


def attempt(call: Callable[[], Any]) -> tuple[str, str, float]:
    """(the error's type or "ok", its message or "", seconds) of `call()`."""
    start = time.perf_counter()
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - every outcome is recorded, the tests judge it
        return type(exc).__name__, str(exc), time.perf_counter() - start
    return "ok", "", time.perf_counter() - start


@contextlib.contextmanager
def invariant_setting(on: bool) -> Iterator[None]:
    """MEGATRON_RL_PATCHES_INVARIANT=1 in this rank's environment when `on`."""
    before = os.environ.pop(INVARIANT, None)
    if on:
        os.environ[INVARIANT] = "1"
    try:
        yield
    finally:
        os.environ.pop(INVARIANT, None)
        if before is not None:
            os.environ[INVARIANT] = before


def with_setting(on: bool, call: Callable[[], Any]) -> Callable[[], Any]:
    """`call` run with the invariant setting on this rank when `on`."""
    def run() -> Any:
        with invariant_setting(on):
            return call()
    return run


def run_cases(cases: dict[str, Callable[[], Any]], layouts: list[Any],
              only: set[str] | None = None) -> dict[str, tuple[str, str, float]]:
    """Each case's attempt (those in `only`, when given), bounded, then a barrier: none left a rank waiting."""
    import torch.distributed as dist

    with bounded(layouts):
        out = {name: attempt(call) for name, call in cases.items() if only is None or name in only}
        dist.barrier()
    return out


def _past(tokens: torch.Tensor, sample: int, position: int, value: int) -> torch.Tensor:
    changed = tokens.clone()
    changed[sample, position] = value
    return changed


def tp2_cases(rank: int, chunks: list, whole: list, tokens: torch.Tensor, labels: torch.Tensor,
              ids: torch.Tensor, vocab: int, only: set[str] | None = None) -> dict[str, tuple[str, str, float]]:
    """The cases at TeacherLayout(tp=2) over 2 ranks (each rank its own rows; rank 1 the odd one out)."""
    from megatron_rl_patches.inference import (
        TeacherLayout,
        hidden_at_layout,
        output_weight_at_layout,
        score_at_layout,
        select_topk_at_layout,
        teacher_groups,
        topk_at_layout,
    )
    from megatron_rl_patches.ops import log_probs_and_entropy

    odd = rank == 1
    tp2 = TeacherLayout(tp=2)
    tp_group = chunks[0].teacher_groups.tp_group
    bad_ids = ids.clone()
    bad_ids[0, 1, 2] = vocab
    padded, mask = ids.clone(), torch.ones(ids.shape, dtype=torch.bool)
    padded[:, :, 3], mask[:, :, 3] = -1, False  # union_ids' padding: never read, accepted
    logits = torch.randn(6, 512, generator=torch.Generator().manual_seed(9))  # this rank's half of 1024 columns
    targets = torch.arange(6) * 100

    def invariant_alike() -> None:  # negative control: the setting on both ranks is the mode of invariant=True
        with invariant_setting(True):
            setting = log_probs_and_entropy(logits, targets, tp_group=tp_group)[0]
        if not torch.equal(setting, log_probs_and_entropy(logits, targets, tp_group=tp_group, invariant=True)[0]):
            raise AssertionError("the setting on both ranks is not the mode of invariant=True")

    cases: dict[str, Callable[[], Any]] = {
        # item 4: ids the teacher's vocabulary does not hold, on one rank
        "token_past_vocab": lambda: score_at_layout(chunks, _past(tokens, 1, 3, vocab) if odd else tokens, labels),
        "token_negative": lambda: score_at_layout(chunks, tokens if odd else _past(tokens, 1, 2, -5), labels),
        "label_past_vocab": lambda: score_at_layout(chunks, tokens, _past(labels, 2, 0, vocab + 7) if odd else labels),
        "topk_id_past_vocab": lambda: topk_at_layout(chunks, tokens, bad_ids if odd else ids),
        "topk_masked_padding": lambda: topk_at_layout(chunks, tokens, padded, ids_mask=mask),
        "hidden_token_past_vocab": lambda: hidden_at_layout(chunks,
                                                            _past(tokens, 0, 0, vocab + 100) if odd else tokens),
        # item 5: an argument given on one rank only, or differing between ranks
        "temperature_zero": lambda: score_at_layout(chunks, tokens, labels, temperature=0.0 if odd else 1.0),
        "temperature_text": lambda: score_at_layout(chunks, tokens, labels, temperature="1" if odd else 1.0),
        "temperature_differs": lambda: score_at_layout(chunks, tokens, labels, temperature=0.5 if odd else 1.0),
        "vocab_size_differs": lambda: score_at_layout(chunks, tokens, labels, vocab_size=1024 if odd else None),
        "layout_differs": lambda: score_at_layout(chunks, tokens, labels, layout=TeacherLayout(pp=2) if odd else tp2),
        "student_chunks": lambda: score_at_layout(whole if odd else chunks, tokens, labels, layout=tp2),
        "k_zero": lambda: select_topk_at_layout(chunks, tokens, labels, 0 if odd else 3),
        "k_differs": lambda: select_topk_at_layout(chunks, tokens, labels, 4 if odd else 3),
        "ids_mask_bad": lambda: topk_at_layout(chunks, tokens, ids, ids_mask=mask.long() if odd else mask),
        "ids_mask_one_rank": lambda: topk_at_layout(chunks, tokens, ids, ids_mask=mask if odd else None),
        "different_calls": lambda: (topk_at_layout(chunks, tokens, ids) if odd
                                    else score_at_layout(chunks, tokens, labels)),
        "output_weight_student_chunks": lambda: output_weight_at_layout(whole if odd else chunks, layout=tp2),
        "lookup_differs": lambda: teacher_groups(TeacherLayout(pp=2) if odd else tp2),
        "lookup_unholdable": lambda: teacher_groups(TeacherLayout(tp=3) if odd else tp2),
        # the invariant mode on one rank only: the ops' collectives would differ
        "invariant_one_rank": with_setting(odd, lambda: score_at_layout(chunks, tokens, labels)),
        "invariant_one_rank_op": with_setting(odd, lambda: log_probs_and_entropy(logits, targets, tp_group=tp_group)),
        "invariant_both_ranks_op": invariant_alike,
        # a backend one rank refuses: before the op's first collective, so on every rank
        "backend_unknown_one_rank": lambda: log_probs_and_entropy(logits, targets, tp_group=tp_group,
                                                                  backend="tiles" if odd else None),
    }
    return run_cases(cases, [tp2, TeacherLayout(pp=2)], only)


def pp2_cases(rank: int, chunks: list, tokens: torch.Tensor, labels: torch.Tensor,
              vocab: int, only: set[str] | None = None) -> dict[str, tuple[str, str, float]]:
    """The cases at TeacherLayout(pp=2) over 2 ranks (rank 0 the first stage, rank 1 the last)."""
    from megatron_rl_patches.inference import TeacherLayout, score_at_layout

    cases: dict[str, Callable[[], Any]] = {
        # the first stage embeds both ranks' rows: an id past the vocabulary was a bare IndexError there
        f"pp2_token_past_vocab_rank{stage}": (lambda given: lambda: score_at_layout(chunks, given, labels))(
            _past(tokens, 0, 1, vocab + 3) if rank == stage else tokens) for stage in (0, 1)}
    # past the padded vocabulary too: the first stage's embedding raised a bare IndexError
    far = _past(tokens, 1, 0, 5000) if rank == 0 else tokens
    cases["pp2_token_past_padding"] = lambda: score_at_layout(chunks, far, labels)
    cases["pp2_temperature_differs"] = lambda: score_at_layout(chunks, tokens, labels, temperature=2.0 if rank else 1.0)
    cases["pp2_temperature_zero"] = lambda: score_at_layout(chunks, tokens, labels,
                                                            temperature=0.0 if rank == 0 else 1.0)
    return run_cases(cases, [TeacherLayout(tp=2), TeacherLayout(pp=2)], only)


def build_cases(rank: int, root: str, only: set[str] | None = None) -> dict[str, tuple[str, str, float]]:
    """build_inference_model_from_hf(path, layout=TeacherLayout(tp=2)) with a failure on rank 1
    only at each step before the build: an argument, the layout, the path, the architecture, the
    weight files, the budget, and values that must match (dtype, layout, vocabulary padding)."""
    from megatron_rl_patches import build_inference_model_from_hf
    from megatron_rl_patches.inference import ResidencyBudget, TeacherLayout

    odd = rank == 1
    tp2 = TeacherLayout(tp=2)
    scratch = Path(tempfile.mkdtemp())  # this rank's own
    unserved = scratch / "unserved"
    unserved.mkdir()
    (unserved / "config.json").write_text('{"model_type": "not_a_family", "architectures": ["NotAFamily"]}')
    no_weights = scratch / "no_weights"
    shutil.copytree(root, no_weights)
    for file in no_weights.glob("*.safetensors"):
        file.unlink()

    def build(path: Any = root, **options: Any) -> Callable[[], Any]:
        options = {"dtype": torch.float32, "layout": tp2, **options}
        return lambda: build_inference_model_from_hf(path, **options)

    cases = {
        "build_bad_argument": build(residency="stream", prefetch=-1 if odd else 1),
        "build_not_a_layout": build(layout={"tp": 2} if odd else tp2),
        "build_layout_differs": build(layout=TeacherLayout(pp=2) if odd else tp2),
        "build_missing_path": build(f"{root}_missing" if odd else root),
        "build_unserved_architecture": build(unserved if odd else root),
        "build_missing_weights": build(no_weights if odd else root),
        "build_budget": build(residency="swap", budget=ResidencyBudget(bytes=1 if odd else 1 << 30)),
        "build_dtype_differs": build(dtype=torch.bfloat16 if odd else torch.float32),
        "build_padding_differs": build(make_vocab_size_divisible_by=64 if odd else 128),
    }
    out = run_cases(cases, [tp2, TeacherLayout(pp=2)], only)
    shutil.rmtree(scratch, ignore_errors=True)
    return out


def four_rank_cases(rank: int, built: dict[str, list], root: str, tokens: torch.Tensor, labels: torch.Tensor,
                    vocab: int, only: set[str] | None = None) -> dict[str, tuple[str, str, float]]:
    """The cases over 4 ranks: `built` holds the chunks at TeacherLayout(tp=2, pp=2) (one replica of
    4) and TeacherLayout(pp=2) (replicas {0, 2} and {1, 3}); rank 2 has no rows."""
    from megatron_rl_patches import build_inference_model_from_hf
    from megatron_rl_patches.inference import TeacherLayout, score_at_layout, teacher_groups

    tp2pp2, pp2 = built["tp2pp2"], built["pp2"]
    cases: dict[str, Callable[[], Any]] = {
        "tp2pp2_token_past_vocab": lambda: score_at_layout(
            tp2pp2, _past(tokens, 2, 3, vocab + 2) if rank == 3 else tokens, labels),
        "tp2pp2_vocab_size_differs": lambda: score_at_layout(tp2pp2, tokens, labels,
                                                             vocab_size=1024 if rank == 0 else None),
        "tp2pp2_invariant_one_rank": with_setting(rank == 2, lambda: score_at_layout(tp2pp2, tokens, labels)),
        # the replica {1, 3} refuses; {0, 2} scores, untouched
        "pp2_temperature_zero": lambda: score_at_layout(pp2, tokens, labels, temperature=0.0 if rank == 3 else 1.0),
        "build_missing_path": lambda: build_inference_model_from_hf(
            f"{root}_missing" if rank == 2 else root, dtype=torch.float32, layout=TeacherLayout(tp=2)),
        "lookup_differs": lambda: teacher_groups(TeacherLayout(pp=2) if rank == 1 else TeacherLayout(tp=2, pp=2)),
    }
    layouts = [TeacherLayout(tp=2, pp=2), TeacherLayout(pp=2), TeacherLayout(tp=2), TeacherLayout(tp=4)]
    return run_cases(cases, layouts, only)
