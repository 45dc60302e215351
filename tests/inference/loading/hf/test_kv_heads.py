"""Key/value heads repeated where the tensor-parallel size exceeds them (families/kv_heads.py):
which sizes are served and refused by name; each rank's fused linear_qkv (plain and Qwen3.5's gated)
equals the one of a checkpoint whose key/value heads were copied with torch's repeat_interleave
(HF query head h uses head h // (H/G): copies made so keep that) at the same size, reading only the
rank's own head; and the memory plan counts what a rank holds. No megatron-core; the log-probs of
such a teacher at tp=2 against the whole teacher are checked in the 2-rank teacher-layout world
(tests/inference/teacher_layout/test_teacher_layout_families.py)."""
from __future__ import annotations

from dataclasses import replace
from math import prod

import pytest
import torch

from megatron_rl_patches.inference.loading.hf.families import architecture, split_problems
from megatron_rl_patches.inference.loading.hf.families.kv_heads import kv_repeat, query_groups
from megatron_rl_patches.inference.loading.hf.memory_plan import layer_params
from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config

QKV = "self_attention.linear_qkv.weight"


@pytest.mark.parametrize(("heads", "kv", "tp", "groups"), [
    (4, 2, 1, 2), (4, 2, 2, 2), (4, 2, 4, 4), (4, 1, 2, 2), (4, 1, 4, 4), (24, 4, 8, 8), (32, 8, 16, 16),
    (16, 2, 8, 8)])
def test_the_query_groups_built_are_the_key_value_heads_repeated_up_to_tp(heads, kv, tp, groups):
    arch = architecture(tiny_hf_config("qwen3", num_attention_heads=heads, num_key_value_heads=kv))
    assert query_groups(arch, tp) == groups and kv_repeat(arch, tp) == groups // kv
    assert split_problems(arch, tp) == []


@pytest.mark.parametrize(("heads", "kv", "tp", "words"), [
    (24, 4, 6, "num_key_value_heads=4 is not a multiple of the tensor-parallel size 6 (nor a divisor of it"),
    (6, 3, 2, "num_key_value_heads=3 is not a multiple of the tensor-parallel size 2"),
    (6, 2, 4, "num_attention_heads=6 is not a multiple of the tensor-parallel size 4 (its num_key_value_heads=2 "
              "would be repeated 2 times"),
    (4, 1, 8, "num_attention_heads=4 is not a multiple of the tensor-parallel size 8")])
def test_a_tp_that_neither_divides_nor_repeats_the_heads_is_refused_by_name(heads, kv, tp, words):
    arch = architecture(tiny_hf_config("qwen3", num_attention_heads=heads, num_key_value_heads=kv))
    assert kv_repeat(arch, tp) == 1
    (problem,) = split_problems(arch, tp)
    assert words in problem


def _filled(kind, arch, tensors, rank, size):
    shape, pieces = kind.shard(arch, tensors, rank, size, 1024)
    target = torch.full(shape, float("nan"))
    for where, value in pieces:
        where(target).copy_(value if value is not None else 0)
    assert not target.isnan().any()
    return target


def _repeated_checkpoint(arch, params, tensors, r):
    """The architecture and the tensors of the same model with each key/value head copied r times
    (repeat_interleave: copy j of head g is head g * r + j), which megatron-core splits without repeating."""
    wide = replace(arch, num_kv_heads=arch.num_kv_heads * r)
    out = dict(tensors)
    for name in params[QKV].hf[1:]:
        heads = tensors[name].reshape(arch.num_kv_heads, arch.head_dim, -1)
        out[name] = heads.repeat_interleave(r, dim=0).flatten(0, 1)
    return wide, out


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize(("kv", "size"), [(1, 2), (1, 4), (2, 4)])
def test_each_ranks_linear_qkv_is_the_repeated_checkpoints(kind, kv, size):
    overrides = {"num_key_value_heads": kv}
    if kind == "qwen3_5":
        overrides.update(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    arch = architecture(tiny_hf_config(kind, **overrides))
    layer = arch.num_layers - 1  # a full-attention layer (qwen3_5's last)
    family = arch.family
    shapes, params = family.layer_tensors(arch, layer), family.layer_params(arch, layer)
    gen = torch.Generator().manual_seed(size)
    tensors = {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}
    r = size // kv
    wide, wide_tensors = _repeated_checkpoint(arch, params, tensors, r)
    param = params[QKV]
    rows = []
    for rank in range(size):
        got = _filled(param.kind, arch, [tensors[n] for n in param.hf], rank, size)
        want = _filled(param.kind, wide, [wide_tensors[n] for n in param.hf], rank, size)
        assert torch.equal(got, want), (kind, rank)
        rows.append(got)
        assert param.kind.rank_params(arch, [prod(shapes[n]) for n in param.hf], size) == got.numel()
    # the queries differ between ranks, the key/value head is shared by the r ranks of a head
    assert not torch.equal(rows[0], rows[1])
    held = layer_params(arch, layer, size).per_gpu
    wide_held = layer_params(wide, layer, size).per_gpu
    assert held == wide_held  # a rank holds what the copied checkpoint's rank holds


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_a_rank_takes_only_its_own_key_value_head(kind):
    """2 key/value heads at tp=4: rank t's fill picks only head t // 2's rows of k and v (the other
    head's rows are NaN here and never reach it; plain q/k/v are views of those rows, the gated one
    slices them alone: views.fused_rows), and every one of them."""
    overrides = {"num_key_value_heads": 2, "num_hidden_layers": 2}
    if kind == "qwen3_5":
        overrides["layer_types"] = ["linear_attention", "full_attention"]
    arch = architecture(tiny_hf_config(kind, **overrides))
    family = arch.family
    shapes, params = family.layer_tensors(arch, 1), family.layer_params(arch, 1)
    param = params[QKV]
    hd = arch.head_dim
    for rank in range(4):
        head = rank // 2
        q, k, v = (torch.randn(shapes[n]) for n in param.hf)
        mine = [x[head * hd:(head + 1) * hd].clone() for x in (k, v)]
        for x in (k, v):
            x[(1 - head) * hd:(2 - head) * hd] = float("nan")
        got = _filled(param.kind, arch, [q, k, v], rank, 4)  # no NaN: the other head is never taken
        assert torch.equal(got[-2 * hd:], torch.cat(mine)), (kind, rank)  # [queries (gates), key, value]


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5_text"])
def test_transformers_own_forward_is_unchanged_by_the_copies_the_fill_repeats(kind, tmp_path):
    """The premise, against transformers' forward: the model with each of its 2 key/value heads
    copied twice by repeat_interleave (4 heads) gives the same logits (torch's tile-like `repeat`,
    which pairs query heads with the wrong key/value head, does not): the fills above equal that
    model's at tp=4, which megatron-core splits as it always has."""
    pytest.importorskip("transformers")
    from megatron_rl_patches.testing.hf_checkpoints import save_tiny_hf

    model = save_tiny_hf(tmp_path / "two", kind, num_key_value_heads=2)
    copied = save_tiny_hf(tmp_path / "four", kind, num_key_value_heads=4)
    tokens = torch.randint(0, 1001, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(tokens).logits

        def logits(copy):
            state = {name: copy(t) if name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")) else t
                     for name, t in model.state_dict().items()}
            copied.load_state_dict(state)
            return copied(tokens).logits

        hd = model.config.head_dim
        right = logits(lambda t: t.reshape(2, hd, -1).repeat_interleave(2, dim=0).flatten(0, 1))
        wrong = logits(lambda t: t.reshape(2, hd, -1).repeat(2, 1, 1).flatten(0, 1))
    assert (right - want).abs().max().item() < 1e-5
    assert (wrong - want).abs().max().item() > 1e-3
