"""The plan's attention against each sample's own causal attention in float64 (values and the
gradients of query, key and value, grouped-query heads), both routes (FlexAttention forward-only on
CPU, as torch runs it there), a route name checked."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

from megatron_rl_patches.shared_prefix.attention import shared_prefix_attention
from megatron_rl_patches.shared_prefix.plan import plan_shared_prefix

HEADS, GROUPS, WIDTH = 4, 2, 8


def _batch(prompt: int, responses: list[int], alone: list[int], padding: int = 3, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 50, (prompt,), generator=gen).tolist()
    samples = [shared + torch.randint(0, 50, (n,), generator=gen).tolist() for n in responses]
    samples += [torch.randint(50, 99, (n,), generator=gen).tolist() for n in alone]
    tokens = torch.tensor([t for s in samples for t in s] + [0] * padding)
    cu = [0]
    for s in samples:
        cu.append(cu[-1] + len(s))
    return samples, cu, plan_shared_prefix(tokens, cu, pad_to=4)


def _reference(q, k, v, plan, cu, samples, scale, window=None, sink=None):
    """Each sample's own causal attention in float64 (a sliding `window` of earlier positions, a
    `sink` logit per head as megatron-core's SoftmaxOne adds it), its rows gathered from the physical
    stream through the plan: [T, b, h * d] on the samples' logical rows."""
    outs = []
    for i, sample in enumerate(samples):
        rows = plan.logical_rows[cu[i]:cu[i] + len(sample)]
        qi, ki, vi = (t[rows].double().permute(1, 2, 0, 3) for t in (q, k, v))
        ki, vi = (t.repeat_interleave(HEADS // GROUPS, dim=1) for t in (ki, vi))
        scores = qi @ ki.transpose(-1, -2) * scale
        seen = torch.ones(len(sample), len(sample), dtype=torch.bool).tril()
        if window is not None:
            seen &= ~torch.ones_like(seen).tril(-window - 1)
        scores = scores.masked_fill(~seen, -math.inf)
        if sink is not None:
            column = sink.double().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
            probs = torch.cat([scores, column], -1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        outs.append((probs @ vi).permute(2, 0, 1, 3).flatten(2))
    return torch.cat(outs)


@pytest.mark.parametrize(("prompt", "responses", "alone"), [
    (40, [5, 9, 3], [12]),           # a group, a sample alone
    (1, [4, 4], []),                 # a one-token prompt
    (20, [6], [7, 3]),               # a group of one: the ordinary path
    (33, [2, 5, 1, 8, 3, 2, 6, 4], []),  # G = 8
])
def test_the_mask_route_equals_each_samples_own_attention_values_and_gradients(prompt, responses, alone):
    samples, cu, plan = _batch(prompt, responses, alone)
    gen = torch.Generator().manual_seed(1)
    shape = (plan.physical_length, 2)
    q = torch.randn(*shape, HEADS, WIDTH, generator=gen, requires_grad=True)
    k = torch.randn(*shape, GROUPS, WIDTH, generator=gen, requires_grad=True)
    v = torch.randn(*shape, GROUPS, WIDTH, generator=gen, requires_grad=True)
    scale = 0.3
    out = shared_prefix_attention(q, k, v, plan, scale=scale, route="mask")
    assert out.shape == (plan.physical_length, 2, HEADS * WIDTH)
    logical = plan.logical_rows[:cu[-1]]
    got = out[logical]
    want = _reference(q, k, v, plan, cu, samples, scale)
    assert (got.double() - want).abs().max() < 1e-6
    weights = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    (got.double() * weights).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    (want * weights).sum().backward()
    for got_grad, t in zip(grads, (q, k, v)):
        assert (got_grad.double() - t.grad.double()).abs().max() < 1e-5 * max(1.0, float(t.grad.abs().max()))


def test_the_flex_route_equals_the_mask_route_without_gradients_on_cpu(monkeypatch):
    flex_module = pytest.importorskip("torch.nn.attention.flex_attention")
    # torch warns once a process that it runs FlexAttention eagerly (the proof that flex ran here): an
    # earlier module's flex call in the same worker must not have spent that warning
    monkeypatch.setattr(flex_module, "_WARNINGS_SHOWN", set(), raising=False)
    samples, cu, plan = _batch(37, [4, 7, 2], [9], padding=2)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(plan.physical_length, 1, HEADS, WIDTH, generator=gen)
    k, v = (torch.randn(plan.physical_length, 1, GROUPS, WIDTH, generator=gen) for _ in range(2))
    with pytest.warns(UserWarning, match="without torch.compile"):
        flex = shared_prefix_attention(q, k, v, plan, scale=0.25, route="flex")
    mask = shared_prefix_attention(q, k, v, plan, scale=0.25, route="mask")
    rows = plan.logical_rows[:cu[-1]]
    assert (flex[rows] - mask[rows]).abs().max() < 1e-5


def test_megatrons_squeezed_packed_layout_and_a_bad_route():
    samples, cu, plan = _batch(5, [2, 3], [])
    q = torch.randn(plan.physical_length, HEADS, WIDTH)
    k, v = torch.randn(plan.physical_length, GROUPS, WIDTH), torch.randn(plan.physical_length, GROUPS, WIDTH)
    out = shared_prefix_attention(q, k, v, plan, scale=0.5)
    assert out.shape == (plan.physical_length, 1, HEADS * WIDTH)
    with pytest.raises(ValueError, match="route must be one of auto, mask, flex"):
        shared_prefix_attention(q, k, v, plan, scale=0.5, route="dense")
    with pytest.raises(ValueError, match="the plan's stream"):
        shared_prefix_attention(q[:-1], k[:-1], v[:-1], plan, scale=0.5)


def _tree(per_turn=False, seed=0):
    from kit.shared_prefix import tree_batch

    batch = tree_batch(system=19, turns=((4, 6, 2), (3, 5, 3)), per_turn=per_turn, alone=(7,), padding=3, seed=seed)
    return batch.sequences, batch.cu_seqlens.tolist(), plan_shared_prefix(batch.tokens, batch.cu_seqlens,
                                                                          samples=batch.samples, pad_to=4)


@pytest.mark.parametrize("per_turn", [False, True])
def test_a_multi_level_tree_equals_each_samples_own_attention_in_float64(per_turn):
    samples, cu, plan = _tree(per_turn)
    assert int(plan.segment_depths.max()) >= 2  # ancestors at more than one level
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(plan.physical_length, 2, HEADS, WIDTH, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(plan.physical_length, 2, GROUPS, WIDTH, generator=gen, dtype=torch.float64,
                        requires_grad=True) for _ in range(2))
    out = shared_prefix_attention(q, k, v, plan, scale=0.4, route="mask")
    got = out[plan.logical_rows[:cu[len(samples)]]]
    want = _reference(q, k, v, plan, cu, samples, 0.4)
    assert (got - want).abs().max() < 1e-12
    weights = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((got * weights).sum(), (q, k, v))
    wants = torch.autograd.grad((want * weights).sum(), (q, k, v))
    for g, w in zip(grads, wants):
        assert (g - w).abs().max() < 1e-12 * max(1.0, float(w.abs().max()))


def test_both_routes_are_made_from_the_one_rule():
    """The CPU route's blocks cover exactly the pairs `sees` allows (each once), the dense fallback
    is `sees` itself, and it equals the block route."""
    from megatron_rl_patches.shared_prefix.attention import rule_masked_attention, rule_pieces
    from megatron_rl_patches.shared_prefix.attention_rule import dense

    _, _, plan = _tree()
    length = plan.physical_length
    covered = torch.zeros(length, length, dtype=torch.int64)
    for block in rule_pieces(plan):
        (first, last), (start, end) = block.rows, block.keys
        full = torch.ones(last - first, end - start, dtype=torch.int64)
        covered[first:last, start:end] += full.tril() if block.causal else full
    rule = dense(length, plan.reach)
    assert torch.equal(covered, rule.long())
    for row in range(length):  # the rule itself: the row's own sample's rows, causally (through the logical map)
        assert rule[row, row] and not rule[row, row + 1:].any()
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(length, 1, HEADS, WIDTH, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(length, 1, GROUPS, WIDTH, generator=gen, dtype=torch.float64) for _ in range(2))
    blocked = shared_prefix_attention(q, k, v, plan, scale=0.3, route="mask")
    masked = rule_masked_attention(q, k, v, plan, 0.3, 0.0).flatten(2)
    assert (blocked - masked).abs().max() < 1e-12


def test_the_flex_route_runs_the_tree_rule_on_cpu():
    pytest.importorskip("torch.nn.attention.flex_attention")
    samples, cu, plan = _tree()
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(plan.physical_length, 1, HEADS, WIDTH, generator=gen)
    k, v = (torch.randn(plan.physical_length, 1, GROUPS, WIDTH, generator=gen) for _ in range(2))
    with warnings.catch_warnings():  # torch warns once a process that it runs FlexAttention eagerly
        warnings.simplefilter("ignore", UserWarning)
        flex = shared_prefix_attention(q, k, v, plan, scale=0.25, route="flex")
        windowed = shared_prefix_attention(q, k, v, plan, scale=0.25, route="flex", window=3)  # its own mask
    rows = plan.logical_rows[:cu[len(samples)]]
    assert (flex[rows].double() - _reference(q, k, v, plan, cu, samples, 0.25)).abs().max() < 1e-5
    assert (windowed[rows].double() - _reference(q, k, v, plan, cu, samples, 0.25, 3)).abs().max() < 1e-5


def test_the_prefix_keys_are_kept_once_and_grouped():
    """What autograd keeps for the backward of the CPU route: the queries, the keys and values at
    their own grouped width, the output and its log-sum-exp: no copy of a prefix per remainder."""
    from megatron_rl_patches.apps.bench.measure import SavedBytes

    _, _, plan = _batch(64, [8] * 8, [5], padding=3)
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(plan.physical_length, 1, HEADS, WIDTH, generator=gen, requires_grad=True)
    k, v = (torch.randn(plan.physical_length, 1, GROUPS, WIDTH, generator=gen, requires_grad=True) for _ in range(2))
    with SavedBytes(ignore=[q, k, v]) as saved:
        out = shared_prefix_attention(q * 1, k * 1, v * 1, plan, scale=0.3, route="mask")
    rows = plan.physical_length
    kept = 4 * rows * (2 * HEADS * WIDTH + 2 * GROUPS * WIDTH + HEADS)  # q, out, k, v, log-sum-exp
    assert saved.bytes <= kept
    out.sum().backward()


def test_bfloat16_stays_within_a_bf16_step_of_float32():
    samples, cu, plan = _tree()
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(plan.physical_length, 1, HEADS, WIDTH, generator=gen)
    k, v = (torch.randn(plan.physical_length, 1, GROUPS, WIDTH, generator=gen) for _ in range(2))
    low = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    out = shared_prefix_attention(*low, plan, scale=0.3, route="mask")
    assert out.dtype == torch.bfloat16
    want = shared_prefix_attention(q, k, v, plan, scale=0.3, route="mask")
    assert (out.float() - want).abs().max() < 3e-2
    out.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 and torch.isfinite(t.grad).all() for t in low)


@pytest.mark.parametrize(("window", "with_sink"), [(3, False), (None, True), (5, True), (0, True)])
def test_windows_in_each_tokens_own_positions_and_sinks_are_exact_in_float64(window, with_sink):
    """A sliding window counts each token's own positions (a remainder's window reaches back into its
    ancestors' rows); a sink is a logit column per head; the sink's gradient too; both routes."""
    samples, cu, plan = _tree(per_turn=True)
    gen = torch.Generator().manual_seed(8)
    shape = (plan.physical_length, 2)
    q = torch.randn(*shape, HEADS, WIDTH, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(*shape, GROUPS, WIDTH, generator=gen, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    sink = torch.randn(HEADS, generator=gen, dtype=torch.float64, requires_grad=True) if with_sink else None
    inputs = (q, k, v) + ((sink,) if with_sink else ())
    want = _reference(q, k, v, plan, cu, samples, 0.35, window, sink)
    weights = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    wants = torch.autograd.grad((want * weights).sum(), inputs)
    for route in ("mask", "masked"):
        if route == "mask":
            out = shared_prefix_attention(q, k, v, plan, scale=0.35, route="mask", window=window, sink=sink)
        else:  # the dense fallback (another device, dropout) under the same rule
            from megatron_rl_patches.shared_prefix.attention import rule_masked_attention

            out = rule_masked_attention(q, k, v, plan, 0.35, 0.0, window, sink).flatten(2)
        got = out[plan.logical_rows[:cu[len(samples)]]]
        assert (got - want).abs().max() < 1e-12, route
        grads = torch.autograd.grad((got * weights).sum(), inputs)
        for g, w in zip(grads, wants):
            assert (g - w).abs().max() < 1e-12 * max(1.0, float(w.abs().max())), route
    if window is not None:  # the window cuts: a plain causal tree differs
        plain = shared_prefix_attention(q, k, v, plan, scale=0.35, route="mask", sink=sink)
        assert (plain[plan.logical_rows[:cu[len(samples)]]] - want).abs().max() > 1e-3


def test_a_window_and_a_sink_are_checked():
    _, _, plan = _batch(5, [2, 3], [])
    q = torch.randn(plan.physical_length, 1, HEADS, WIDTH)
    k, v = torch.randn(plan.physical_length, 1, GROUPS, WIDTH), torch.randn(plan.physical_length, 1, GROUPS, WIDTH)
    with pytest.raises(ValueError, match="one logit per query head"):
        shared_prefix_attention(q, k, v, plan, scale=0.5, sink=torch.zeros(GROUPS))
    with pytest.raises(ValueError, match="window must be an int >= 0"):
        shared_prefix_attention(q, k, v, plan, scale=0.5, window=-1)
    with pytest.raises(ValueError, match="the flex route takes no attention sink"):
        shared_prefix_attention(q, k, v, plan, scale=0.5, route="flex", sink=torch.zeros(HEADS))


def test_narrower_values_the_dropout_route_and_the_edges_are_exact_or_refused_whole():
    """Values narrower than queries and keys (multi-latent attention's) against float64; dropout's
    dense route reshaped as the mask route, taking the window and the sink (same seed, same draws);
    `auto` on CPU is the mask route; an empty stream; the head and width refusals said whole; the
    dense route in bfloat16 with a sink near the float32 blocks."""
    from megatron_rl_patches.shared_prefix.attention import chosen_route, rule_masked_attention

    samples, cu, plan = _tree(per_turn=True)
    gen = torch.Generator().manual_seed(9)
    length = plan.physical_length
    q, k = (torch.randn(length, 2, n, WIDTH, generator=gen, dtype=torch.float64) for n in (HEADS, GROUPS))
    v = torch.randn(length, 2, GROUPS, 6, generator=gen, dtype=torch.float64)
    out = shared_prefix_attention(q, k, v, plan, scale=0.3, route="mask")
    assert out.shape == (length, 2, HEADS * 6)
    rows = plan.logical_rows[:cu[len(samples)]]
    assert (out[rows] - _reference(q, k, v, plan, cu, samples, 0.3)).abs().max() < 1e-12
    with pytest.raises(ValueError, match=r"^shared-prefix attention: values wider \(10\) than queries and keys \(8\) "
                                         r"are not taken$"):
        shared_prefix_attention(q, k, torch.randn(length, 2, GROUPS, 10, dtype=torch.float64), plan, scale=0.3)
    with pytest.raises(ValueError, match=r"^shared-prefix attention: 4 query heads do not split into 3 key/value "
                                         r"groups$"):
        shared_prefix_attention(q, k[:, :, :1].expand(-1, -1, 3, -1), v, plan, scale=0.3)
    assert chosen_route("auto", q) == "mask" and chosen_route("flex", q) == "flex"
    v = torch.randn(length, 2, GROUPS, WIDTH, generator=gen, dtype=torch.float64)
    sink = torch.randn(HEADS, generator=gen, dtype=torch.float64)
    torch.manual_seed(0)
    dropped = shared_prefix_attention(q, k, v, plan, scale=0.3, dropout=0.25, window=4, sink=sink)
    torch.manual_seed(0)
    assert torch.equal(dropped, rule_masked_attention(q, k, v, plan, 0.3, 0.25, 4, sink).reshape(length, 2, -1))
    low = rule_masked_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), plan, 0.3, 0.0, None, sink.bfloat16())
    want = shared_prefix_attention(q.float(), k.float(), v.float(), plan, scale=0.3, route="mask", sink=sink.float())
    assert low.dtype == torch.bfloat16 and (low.flatten(2).float() - want).abs().max() < 3e-2
    empty = plan_shared_prefix(torch.zeros(0, dtype=torch.int64), [0])
    none = torch.zeros(0, 2, HEADS, WIDTH)
    assert shared_prefix_attention(none, none[:, :, :GROUPS], none[:, :, :GROUPS], empty, scale=0.3).shape == \
        (0, 2, HEADS * WIDTH)
