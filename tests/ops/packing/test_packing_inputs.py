"""Packing helpers refuse malformed layouts and inputs at construction, naming the argument:
float or None lengths, float / string CP sizes, 0-d tensors, float token ids."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_rl_patches.ops.packing import (
    PackedLayout,
    response_log_probs_and_entropy,
    response_pieces,
    shifted_targets,
    split_responses,
)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(cp_size=2.5), "cp_size must be an int, got float 2.5"),
        (dict(cp_size="2"), "cp_size must be an int, got str '2'"),
        (dict(cp_size=2, cp_rank=1.0), "cp_rank must be an int, got float"),
        (dict(cp_size=True), "cp_size must be an int, got bool"),
        (dict(total_lengths=[8.0, 6]), r"total_lengths\[0\] must be an int, got float 8.0"),
        (dict(total_lengths=[8.7, 6]), r"total_lengths\[0\] must be an int, got float 8.7"),
        (dict(response_lengths=[None, 2]), r"response_lengths\[0\] must be an int, got NoneType"),
        (dict(total_lengths=None), "total_lengths must be a sequence of ints"),
        (dict(total_lengths="86"), "total_lengths must be a sequence of ints"),
        (dict(total_lengths=torch.tensor(8)), "total_lengths must be a 1-D integer tensor .* shape \\[\\]"),
        (dict(total_lengths=torch.tensor([8.0, 6.0])), r"total_lengths\[0\] must be an int, got Tensor"),
        (dict(total_lengths=[torch.tensor(8.0), 6]), r"total_lengths\[0\] must be an int, got Tensor"),
        (dict(response_lengths=[True, 2]), r"response_lengths\[0\] must be an int, got bool"),
        (dict(allgather_cp=1), "allgather_cp must be True or False, got 1"),
        (dict(qkv_format="bshd", max_seq_len=9.5), "max_seq_len must be an int, got float"),
    ],
)
def test_bad_layouts_are_type_errors(kwargs, match):
    layout = dict(total_lengths=[8, 6], response_lengths=[3, 2]) | kwargs
    with pytest.raises(TypeError, match=match):
        PackedLayout(**layout)


def test_negative_lengths_are_value_errors():
    with pytest.raises(ValueError, match=r"total_lengths\[1\] must be >= 0, got -6"):
        PackedLayout([8, -6], [3, 2])


def test_integer_lengths_of_any_kind_are_accepted():
    layout = PackedLayout(torch.tensor([8, 6]), np.array([3, 2]), cp_size=np.int64(2), cp_rank=torch.tensor(1))
    assert layout.total_lengths == (8, 6) and layout.response_lengths == (3, 2)
    assert type(layout.cp_size) is int and type(layout.cp_rank) is int and layout.cp_size == 2


def test_float_token_ids_are_refused_like_the_op_refuses_them():
    layout = PackedLayout([4], [2])
    tokens = torch.tensor([1.0, 2.0, 3.0, 4.0])
    with pytest.raises(TypeError, match=r"tokens\[0\] must be an integer tensor of token ids .* torch.float32"):
        shifted_targets([tokens], layout, 4)
    with pytest.raises(TypeError, match=r"tokens\[0\] must be an integer tensor"):
        shifted_targets([[1, 2, 3, 4]], layout, 4)
    with pytest.raises(TypeError, match=r"tokens\[0\] must be an integer tensor"):
        response_log_probs_and_entropy(torch.randn(4, 10), [tokens], layout)
    assert shifted_targets([tokens.long()], layout, 4).tolist() == [2, 3, 4, 0]


def test_zero_d_tensors_and_bad_row_counts():
    layout = PackedLayout([4], [2])
    with pytest.raises(TypeError, match=r"values must be a tensor with one row per local token .* 0-d tensor"):
        split_responses(torch.tensor(1.0), layout)
    with pytest.raises(TypeError, match=r"logits must be a tensor with one row per local token"):
        response_log_probs_and_entropy(torch.tensor(1.0), [torch.arange(4)], layout)
    with pytest.raises(TypeError, match="num_rows must be an int, got float"):
        response_pieces(layout, 4.0)


def test_boundaries_and_the_given_device_found_by_mutation_testing():
    """A bshd layout whose max_seq_len is the longest sample is accepted (one less is refused); a bad
    num_rows or a list of values is named; shifted_targets' device= wins over the tokens' (meta: no second
    device needed)."""
    assert PackedLayout([8, 6], [3, 2], qkv_format="bshd", max_seq_len=8).max_seq_len == 8
    with pytest.raises(ValueError, match=r"needs max_seq_len >= the longest sample \(8\), got 7"):
        PackedLayout([8, 6], [3, 2], qkv_format="bshd", max_seq_len=7)
    layout, tokens = PackedLayout([4], [2]), [torch.tensor([1, 2, 3, 4])]
    with pytest.raises(TypeError, match="num_rows must be an int"):
        shifted_targets(tokens, layout, 4.5)
    assert shifted_targets(tokens, layout, 4, device="meta").device.type == "meta"
    with pytest.raises(TypeError, match=r"values must be a tensor with one row per local token .*, got list"):
        split_responses([1, 2, 3, 4], layout)
