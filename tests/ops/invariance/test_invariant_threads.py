"""The invariant mode exponentiates with exp2 over buffers that torch walks in whole vector steps
(ops/kernels/whole_vectors.py): every element takes the vector loop's path, so its bits depend
neither on where it sits nor on the thread count. Negative controls: an element at an unpadded
buffer's loop remainder gets other bits (the scalar path) — where this CPU's kernels compute exp2
otherwise on the two paths (torch's vectorized kernels, AVX2 or AVX-512: Sleef's polynomial against
the C library's exp2); with the scalar kernels (ATEN_CPU_CAPABILITY=default) both paths give the
same bits, there is no hazard to show, and the controls say so (skipped)."""
from __future__ import annotations

import contextlib

import pytest
import torch

from megatron_rl_patches import ops
from megatron_rl_patches.ops.kernels.whole_vectors import VECTOR_STEP, padded_rows, padded_width

THREADS = (1, 2, 3)


@contextlib.contextmanager
def _threads(count):
    saved = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(saved)  # the session's other tests keep their threads


def _vector_path(values):
    """exp2 of each value inside a run of whole vector steps on one thread: the vector path."""
    n = values.numel()
    run = torch.zeros(-(-n // VECTOR_STEP) * VECTOR_STEP + VECTOR_STEP)
    run[:n] = values.flatten()
    with _threads(1):
        return torch.exp2(run)[:n].view(values.shape)


def _candidates():
    return torch.rand(1 << 16, generator=torch.Generator().manual_seed(0)) * -30


def _path_differs(values):
    """Values of `values` whose exp2 differs between the vector path and the scalar remainder loop."""
    strided = torch.stack([values, values], dim=1)[:, 0]  # not contiguous: every element on the scalar loop
    return values[torch.exp2(strided) != _vector_path(values)]


def _hazard_or_skip():
    """Skip a control where exp2's two paths give the same bits (no remainder hazard to show)."""
    if _path_differs(_candidates()).numel() < VECTOR_STEP + 1:
        pytest.skip(f"exp2's vector and scalar loops give the same bits with torch's "
                    f"{torch.backends.cpu.get_cpu_capability()} kernels: no remainder hazard here")


def _scalar_differs(count):
    """`count` values whose exp2 differs between the two paths, where they differ; else any values
    (the claims on whole vector buffers hold either way)."""
    values = _candidates()
    differs = _path_differs(values)
    return (differs if differs.numel() >= count else values)[:count]


@pytest.mark.parametrize("threads", THREADS)
def test_exp2_over_a_whole_vector_buffer_takes_the_vector_path_everywhere(threads):
    values = _scalar_differs(1024)
    for rows, cols in ((1, 1), (3, 625), (7, 2048), (17, 999), (40, 5000)):
        real = values.repeat(-(-rows * cols // values.numel()))[: rows * cols].view(rows, cols)
        width = padded_width(cols)
        buffer = torch.zeros(padded_rows(rows, width, threads), width)
        buffer[:rows, :cols] = real
        with _threads(threads):
            got = torch.exp2(buffer)[:rows, :cols]
        assert torch.equal(got, _vector_path(real)), (rows, cols, threads)


def test_an_unpadded_buffer_puts_its_remainder_on_the_scalar_path():
    """The negative control: 33 values, the last one past the only whole step of 32 or 64."""
    _hazard_or_skip()
    values = _scalar_differs(VECTOR_STEP + 1)
    with _threads(1):
        got = torch.exp2(values.clone())
    assert not torch.equal(got, _vector_path(values))


def _inputs(T=48, V=5000, H=64):
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(V, H, generator=g) / H**0.5 * 4
    return (torch.randn(T, V, generator=g) * 3, torch.randn(T, H, generator=g), weight,
            torch.randint(0, V, (T,), generator=g), torch.rand(T, generator=g).add(0.5))


def _both_ops(invariant):
    x, h, weight, tokens, tau = _inputs()
    return {
        "log_probs_and_entropy": ops.log_probs_and_entropy(x, tokens, temperature=tau, with_entropy=True,
                                                           invariant=invariant),
        "lm_head_log_probs_and_entropy": ops.lm_head_log_probs_and_entropy(h, weight, tokens, with_entropy=True,
                                                                           invariant=invariant),
    }


def test_the_invariant_ops_give_the_same_bits_at_every_thread_count():
    """Their buffers split over 2 and 3 threads (above torch's grain). No negative control at this
    level: a remainder element's exp2 moves by one ulp, which the fp32 outputs rarely show (the
    default mode keeps its bits here too); the controls are the exp2 buffers' above."""
    runs = {}
    for threads in THREADS:
        with _threads(threads):
            runs[threads] = _both_ops(True)
    for op in runs[1]:
        for threads in THREADS[1:]:
            for one, other in zip(runs[1][op], runs[threads][op], strict=True):
                assert torch.equal(one, other), (op, threads)


def _row_moves(invariant, tail):
    """Whether a row whose two largest logits end it (the last one `tail`) gets other bits alone
    (its last columns past the exp2 loop's whole steps) than before another row."""
    row = torch.cat([torch.full((1, 35), -20.0), torch.tensor([[0.0, tail]])], dim=1)
    other = torch.zeros(1, 37)
    token = torch.tensor([35])
    alone = ops.log_probs_and_entropy(row, token, with_entropy=True, invariant=invariant)
    before = ops.log_probs_and_entropy(torch.cat([row, other]), torch.tensor([35, 0]), with_entropy=True,
                                       invariant=invariant)
    return any(not torch.equal(a, b[:1]) for a, b in zip(alone, before))


def test_a_row_ending_in_its_largest_logits_keeps_its_bits_at_the_loop_remainder():
    """The ops-level check the outputs can show: a row of 37 logits alone puts its last 5 past the
    whole vector steps; before another row, inside them. The default mode (exp2 over unpadded
    buffers) moves on some of these rows where exp2's two paths differ, the invariant mode on none."""
    tails = torch.rand(300, generator=torch.Generator().manual_seed(1)).neg().tolist()
    with _threads(1):
        assert not any(_row_moves(True, tail) for tail in tails)
        _hazard_or_skip()
        assert any(_row_moves(False, tail) for tail in tails), "the default mode kept every row: no control"
