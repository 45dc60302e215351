"""Fixtures of the Hugging Face teacher tests: transformers (skipped with the reason where it is
missing), no network, and megatron-core's MoE router on CPU."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip(
        "transformers", reason="the reference forward needs transformers (the `hf-test` extra: pip install -e "
        "'.[hf-test]' in the clone)"
    )


@pytest.fixture
def no_build(monkeypatch):
    """Fails the test if a model is built: every refusal of bad input comes before the build
    (both entry points: build_inference_model_from_hf calls build_checked)."""
    import megatron_rl_patches.inference.build as build

    def refuse(*args, **kwargs):
        raise AssertionError("the model was built before the input was refused")

    monkeypatch.setattr(build, "build_inference_model", refuse)
    monkeypatch.setattr(build, "build_checked", refuse)
