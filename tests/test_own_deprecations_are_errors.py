"""The suite runs with the package's own DeprecationWarnings as errors (pyproject.toml's
filterwarnings; issue 29 defect 9): a deprecated argument used anywhere outside the tests that opt
out fails its test. This test has no opt-out, so it fails if the filter goes."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches import topk_kl


def test_a_deprecated_argument_is_an_error_under_the_suite_filter():
    logp = torch.log_softmax(torch.randn(2, 4, 5, dtype=torch.float64), -1)
    with pytest.raises(DeprecationWarning, match="kl=/mix= are deprecated"):
        topk_kl(logp[0, :, :4], logp[0, :, 4], logp[1, :, :4], kl="forward")
