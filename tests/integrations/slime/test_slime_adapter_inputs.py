"""The slime adapter names its argument when `chunk_size` is not an int (slime passes ints; <= 0: none)."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.integrations.slime import calculate_log_probs_and_entropy


@pytest.mark.parametrize("chunk_size", ["4", 4.0, True, [4]])
def test_chunk_size_of_the_wrong_type_is_named(chunk_size):
    logits, tokens = torch.randn(6, 11), torch.randint(0, 11, (6,))
    with pytest.raises(TypeError, match=f"chunk_size must be an int .* got {type(chunk_size).__name__}"):
        calculate_log_probs_and_entropy(logits, tokens, None, chunk_size=chunk_size)


@pytest.mark.parametrize("chunk_size", [-1, 0, 2, None])
def test_int_and_none_chunk_sizes_still_work(chunk_size):
    logits, tokens = torch.randn(6, 11, dtype=torch.float64), torch.randint(0, 11, (6,))
    log_prob, _ = calculate_log_probs_and_entropy(logits, tokens, None, chunk_size=chunk_size)
    expected = torch.log_softmax(logits, -1).gather(1, tokens[:, None])
    torch.testing.assert_close(log_prob, expected)
