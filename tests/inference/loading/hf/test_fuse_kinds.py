"""Fuse kinds as objects (families/fuse_kind.py): a kind's arity is enforced by the contract and
before a fill; its `split` rule is what its fill does (checked on every parameter of every family:
the memory plan counts by it); and a kind registered in one module (this one) is picked up by the
converter, the contract and the memory plan with no other file touched. No megatron-core."""
from __future__ import annotations

import dataclasses
from math import prod

import pytest
import torch

from megatron_rl_patches.inference.loading.hf.contract import contract_problems
from megatron_rl_patches.inference.loading.hf.convert import Source, shard_pieces, source
from megatron_rl_patches.inference.loading.hf.families import FAMILIES, architecture, qwen3
from megatron_rl_patches.inference.loading.hf.families.common import dense_layer_params
from megatron_rl_patches.inference.loading.hf.families.common_kinds import QKV, ROW
from megatron_rl_patches.inference.loading.hf.families.family import Param
from megatron_rl_patches.inference.loading.hf.families.fuse_kind import (
    FuseKind,
    fuse_kind,
    register,
    registered,
    unregister,
)
from megatron_rl_patches.inference.loading.hf.families.views import whole
from megatron_rl_patches.inference.loading.hf.memory_plan import layer_params
from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config

PROJ = "self_attention.linear_proj.weight"
VOCAB_PAD = 1024


class WholeRow(FuseKind):
    """A new kind: the attention's output projection held whole by every rank."""

    name, split = "test_whole_row", False

    def pieces(self, arch, tensors, rank, size, padded_vocab):
        return whole(tensors[0])


class Summed(FuseKind):
    """A kind fusing two tensors (their sum), split by rows."""

    name, arity = "test_summed", 2

    def pieces(self, arch, tensors, rank, size, padded_vocab):
        return whole((tensors[0] + tensors[1]).chunk(size, dim=0)[rank])


WHOLE_ROW, SUMMED = WholeRow(), Summed()


@pytest.fixture(autouse=True, scope="module")
def test_kinds():
    """This module's kinds registered while its tests run, then removed: the registry as before."""
    before = registered()
    register(WHOLE_ROW), register(SUMMED)
    yield
    unregister(WHOLE_ROW), unregister(SUMMED)
    assert registered() == before


def test_a_kind_can_be_unregistered_only_by_itself():
    with pytest.raises(ValueError, match=r"fuse kind 'row' \(WholeRow\) is not the registered one"):
        unregister(type("WholeRow", (FuseKind,), {"name": "row"})())


def _family(kind):
    def layer_params_(arch, layer):
        return {**dense_layer_params(arch, layer), PROJ: Param(("self_attn.o_proj.weight",), kind)}

    return dataclasses.replace(qwen3.FAMILY, name="kinded", layer_params=layer_params_)


def test_a_kind_registered_in_one_module_is_picked_up_by_convert_contract_and_plan():
    config = tiny_hf_config("qwen3")
    arch = architecture(config)
    family = _family("test_whole_row")  # by its registered name
    assert contract_problems(family, config) == []
    src = source(arch, f"decoder.layers.1.{PROJ}", {1: 1}, 0, family)
    assert src.kind is WHOLE_ROW and src.hf_names == ("model.layers.1.self_attn.o_proj.weight",)
    o_proj = torch.randn(arch.hidden_size, arch.num_heads * arch.head_dim)
    shape, pieces = shard_pieces(arch, src, [o_proj], 1, 2, VOCAB_PAD)
    assert shape == tuple(o_proj.shape) and pieces[0][1] is o_proj  # whole on rank 1 of 2, a view
    ours, split = (layer_params(arch, 0, tp=2, family=f).per_gpu for f in (family, qwen3.FAMILY))
    assert ours - split == o_proj.numel() // 2  # the plan counts it whole at TP 2


def test_a_kind_s_arity_is_enforced_by_the_contract_and_the_fill():
    config = tiny_hf_config("qwen3")
    arch = architecture(config)
    problems = contract_problems(_family(SUMMED), config)
    assert any(f"{PROJ} of kind 'test_summed' fuses 1 tensors, expected 2" in p for p in problems), problems
    t = torch.randn(arch.hidden_size, arch.hidden_size)
    with pytest.raises(ValueError, match=r"fuse kind 'test_summed' fuses 2 tensors, got 1"):
        shard_pieces(arch, Source(("x",), SUMMED, False), [t], 0, 1, VOCAB_PAD)
    with pytest.raises(ValueError, match=r"fuse kind 'qkv' fuses 3 tensors, got 2"):
        QKV.shard(arch, [t, t], 0, 1, VOCAB_PAD)
    shape, pieces = shard_pieces(arch, Source(("x", "y"), SUMMED, False), [t, t], 1, 2, VOCAB_PAD)
    assert shape == (arch.hidden_size // 2, arch.hidden_size) and torch.equal(pieces[0][1], (2 * t).chunk(2)[1])


def test_kind_names_resolve_once_and_wrong_ones_are_named():
    assert Param(("a",), "row").kind is ROW and Source(("a",), "qkv", False).kind is QKV and fuse_kind(ROW) is ROW
    with pytest.raises(ValueError, match=r"unknown fuse kind 'rows'; registered: .*\brow\b"):
        Param(("a",), "rows")
    with pytest.raises(ValueError, match=r"fuse kind 'row' is already registered \(Row\)"):
        register(type("OtherRow", (FuseKind,), {"name": "row"})())
    with pytest.raises(ValueError, match=r"a fuse kind needs a name and an arity >= 1"):
        register(type("Nameless", (FuseKind,), {})())
    with pytest.raises(NotImplementedError, match=r"fuse kind 'x' \(Empty\) fills no slice"):
        type("Empty", (FuseKind,), {"name": "x"})().pieces(None, [], 0, 1, 1)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_kind_fills_what_its_split_rule_says(family):
    """At TP 2, a parameter of a split kind is cut in two (the ranks' numbers of elements add up to
    TP 1's), one of a whole kind is the same on each rank: what the memory plan counts by."""
    arch = architecture(tiny_hf_config(family.name))
    gen = torch.Generator().manual_seed(0)
    before, after = family.outer_tensors(arch)
    layers = [(family.layer_tensors(arch, i), family.layer_params(arch, i)) for i in range(arch.num_layers)]
    seen = set()
    for tensors, params in [({**before, **after}, family.outer_params(arch)), *layers]:
        for name, param in params.items():
            made = [torch.randn(tensors[hf], generator=gen) for hf in param.hf]
            whole_shape, _ = param.kind.shard(arch, made, 0, 1, VOCAB_PAD)
            shapes = [param.kind.shard(arch, made, rank, 2, VOCAB_PAD)[0] for rank in range(2)]
            if param.kind.split:
                assert sum(prod(s) for s in shapes) == prod(whole_shape), (name, param.kind)
                assert all(prod(s) < prod(whole_shape) for s in shapes), (name, param.kind)
            else:
                assert shapes == [whole_shape] * 2, (name, param.kind)
            seen.add(param.kind)
    assert seen <= set(registered())
