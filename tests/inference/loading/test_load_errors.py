"""The loading errors as users catch them: exported lazily, ValueErrors naming the path, picklable
(multi-rank harnesses ship them between processes), torch's CheckpointException summarized."""
from __future__ import annotations

import pickle
import subprocess
import sys

import megatron_rl_patches.inference as inference


def test_checkpoint_read_error_is_exported_without_importing_torch():
    code = (
        "import sys; from megatron_rl_patches.inference import CheckpointReadError, WeightsMismatchError; "
        "assert issubclass(CheckpointReadError, ValueError) and issubclass(WeightsMismatchError, ValueError); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert "CheckpointReadError" in inference.__all__ and "CheckpointReadError" in dir(inference)


def test_the_message_names_the_path_and_what_became_of_the_model():
    untouched = inference.CheckpointReadError("/ckpt/iter_0000001", "x.distcp is missing")
    assert str(untouched) == (
        "cannot read checkpoint '/ckpt/iter_0000001': x.distcp is missing; nothing was copied: the model is unchanged"
    )
    broken = inference.CheckpointReadError("/ckpt", "reading tensors failed", weights_undefined=True)
    assert "weights are now UNDEFINED" in str(broken) and broken.weights_undefined
    clone = pickle.loads(pickle.dumps(broken))
    assert type(clone) is inference.CheckpointReadError and str(clone) == str(broken)
    assert (clone.path, clone.problem, clone.weights_undefined) == ("/ckpt", "reading tensors failed", True)


def test_torch_checkpoint_exception_is_summarized_by_its_first_failing_rank():
    from torch.distributed.checkpoint import CheckpointException

    from megatron_rl_patches.inference.loading.errors import describe

    failure = CheckpointException("load failed", {1: (OSError(22, "Invalid argument"), None)})
    assert describe(failure) == "rank 1: OSError: [Errno 22] Invalid argument"
    assert describe(RuntimeError("")) == "RuntimeError"
    assert len(describe(ValueError("x" * 5000))) < 400
